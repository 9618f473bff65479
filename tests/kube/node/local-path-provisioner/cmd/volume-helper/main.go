// The test cluster's setupCommand and teardownCommand for local-path-provisioner's helper
// pods, so that their image is one static binary (no shell, no busybox):
//
//	volume-helper -p PATH -s SIZE -m MODE -a create|delete
//
// create makes PATH mode 0700, owned by root: the PVs are `local` volumes, so the kubelet gives
// each pod's fsGroup access to its volume, and nobody else on the host can enter it. delete
// removes PATH and everything in it.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	path := flag.String("p", "", "the volume's directory")
	flag.String("s", "", "size in bytes (ignored: a directory has none)")
	flag.String("m", "", "volume mode (Filesystem)")
	action := flag.String("a", "", "create or delete")
	flag.Parse()
	if *path == "" || *path == "/" {
		fail(fmt.Errorf("-p: a volume directory is required"))
	}
	switch *action {
	case "create":
		if err := os.Mkdir(*path, 0o700); err != nil && !os.IsExist(err) {
			fail(err)
		}
	case "delete":
		if err := os.RemoveAll(*path); err != nil {
			fail(err)
		}
	default:
		fail(fmt.Errorf("-a %q: must be create or delete", *action))
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "volume-helper:", err)
	os.Exit(1)
}
