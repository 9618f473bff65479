package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
)

const (
	annotation = "mcpforge.dev/restore-from"
	// A value of `shared:<archive>` wakes the pod from an archive other pods may wake from
	// too (forks made together): it is left for the node's sweeper, not removed here.
	sharedPrefix = "shared:"
	// The kubelet's count of the container's starts (the handler's container_annotations):
	// a checkpoint is woken from at the first only; a restart is a fresh start.
	restartCount = "io.kubernetes.container.restartCount"
	// runc gives CRIU the options of the file this annotation names (criuConfig).
	criuAnnotation = "org.criu.config"
	criuFile       = "mcpforge-criu.conf"
	marker         = "mcpforge-restored" // in the bundle of a container this program restored
	workDir        = "mcpforge-restore-work"
	maxSpec        = 16 << 20 // config.json and spec.dump, read whole
)

const namespaceKey = "io.kubernetes.cri.sandbox-namespace"

// The spec's fields an archive must share with the new container. Not the pod's name: the
// namespace is the boundary (whoever may make pods in it may read its Secrets), and a
// fork wakes a pod of another name from a session's checkpoint.
var sameAs = []string{
	namespaceKey,
	"io.kubernetes.cri.container-name",
	"io.kubernetes.cri.image-name",
}

var containerID = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`) // not . or ..

type spec struct {
	Annotations map[string]string `json:"annotations"`
	Root        struct {
		Path string `json:"path"`
	} `json:"root"`
	Mounts []mount `json:"mounts"`
	Linux  struct {
		UIDMappings []idMap `json:"uidMappings"`
		GIDMappings []idMap `json:"gidMappings"`
	} `json:"linux"`
}

type mount struct {
	Destination string  `json:"destination"`
	Source      string  `json:"source"`
	Type        string  `json:"type"`
	UIDMappings []idMap `json:"uidMappings"` // an idmapped mount's (volumes.go)
	GIDMappings []idMap `json:"gidMappings"`
}

type idMap struct {
	ContainerID int `json:"containerID"`
	HostID      int `json:"hostID"`
	Size        int `json:"size"`
}

// create restores the container if its spec asks for it: true if it did.
func create(runc string, global, rest []string) (bool, error) {
	bundle := option(rest, "--bundle")
	if bundle == "" {
		bundle = option(rest, "-b")
	}
	if bundle == "" || len(rest) == 0 {
		return false, nil
	}
	var new spec
	if err := readJSON(filepath.Join(bundle, "config.json"), maxSpec, &new); err != nil {
		return false, err
	}
	if new.Annotations["io.kubernetes.cri.container-type"] != "container" {
		return false, nil
	}
	if err := criuConfig(bundle, new.Annotations); err != nil {
		return false, err
	}
	name, ok := new.Annotations[annotation]
	if !ok || (new.Annotations[restartCount] != "" && new.Annotations[restartCount] != "0") {
		return false, nil
	}
	if stored, ok := strings.CutPrefix(name, storePrefix); ok {
		return false, storeFor(bundle, &new, stored) // then made as any container (store.go)
	}
	shared := strings.HasPrefix(name, sharedPrefix)
	name = strings.TrimPrefix(name, sharedPrefix)
	id := rest[len(rest)-1]
	uid, gid := rootOf(new.Linux.UIDMappings), rootOf(new.Linux.GIDMappings)
	if uid <= 0 || gid <= 0 || !containerID.MatchString(id) {
		return false, fmt.Errorf("a pod wakes from a checkpoint only in a user namespace of its own (hostUsers: false)")
	}
	claim, err := claimDir(bundle)
	if err != nil {
		return false, err
	}
	defer flushSpent() // last: after the restore and the room's release
	images, unlock, done, err := room(id)
	if err != nil {
		return false, err
	}
	defer done() // the images go once restored (the pages live in the process), or not
	old, err := wake(images, claim, name, shared, &new)
	if err != nil {
		return false, err
	}
	if err := give(images, uid, gid); err != nil {
		return false, err
	}
	// Beside the images' directories, under a name no container id takes ('+').
	undo, err := idmapped(bundle, filepath.Join(filepath.Dir(images), idmappedDir, id))
	if err != nil {
		return false, err
	}
	defer undo() // the restored container holds mounts of its own
	unlock()     // the images are in place: the node's next wake may put its own beside them
	skipped, err := files(images, rootfsOf(bundle, &new), old, &new, name)
	if err != nil {
		return false, err
	}
	if skipped > 0 {
		note(global, "warning", fmt.Sprintf("checkpoint %s: %d of its files not put back (devices, FIFOs, owners outside the pod's ids)", name, skipped))
	}
	if err := restore(runc, global, rest, bundle, images, name); err != nil {
		return false, err
	}
	return true, os.WriteFile(filepath.Join(bundle, marker), nil, 0o600)
}

// wake puts the CRIU images of the archive `name` (and its writable layer: rootfs.go) in
// images, and says what spec it was checkpointed with: the node's archive if it has
// it, else the copy in the session's claim (store.go), if it is signed. Either is spent:
// a session's snapshot is restored once, whether it wakes from it or cannot (one that
// failed starts its kernel afresh), and the node's disk is not a store of old memories.
// A shared one (forks) is the sweeper's. An archive not of the new container's namespace,
// name and image is refused before anything is spent.
func wake(images, claim, name string, shared bool, new *spec) (*spec, error) {
	archive, err := openArchive(name)
	if errors.Is(err, fs.ErrNotExist) && claim != "" {
		old, err := fromClaim(claim, new.Annotations[namespaceKey], name, images)
		if err == nil {
			err = sameOrigin(old, new, name)
		}
		if err == nil && !shared {
			spendClaim(claim)
		}
		return old, err
	}
	if err != nil {
		return nil, err
	}
	defer archive.Close()
	found, err := scanFor(archive, new, name)
	if err != nil {
		return nil, err
	}
	kept := false
	if !shared {
		// Out of use at once, under the lock; the images linked first if kept (taken.go).
		kept = fromTaken(found.token, found.images, images)
		setAside(archive.Name())
		setAside(takenPath(found.token))
		if claim != "" {
			spendClaim(claim)
		}
	}
	// The writable layer is kept beside the images, until it is put back (files).
	if kept {
		err = fits(filepath.Dir(images), found.diff+headroom)
		if err == nil {
			err = extractDiff(archive, images) // the kept images are CRIU's alone
		}
	} else if err = fits(filepath.Dir(images), found.size+found.diff+headroom); err == nil {
		err = extract(archive, images)
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", name, err)
	}
	return found.spec, nil
}

// files puts the checkpoint's writable layer, kept in images by extraction, back into
// the new container's rootfs (rootfs.go), and its emptyDir volumes into the new pod's
// (volumes.go), then removes both; how many of their entries were skipped.
func files(images, rootfs string, old, new *spec, name string) (int, error) {
	kept := filepath.Join(images, rootfsDiffFile)
	defer os.Remove(kept)
	defer os.Remove(filepath.Join(images, volumesFile))
	defer os.Remove(filepath.Join(images, volumesFailed))
	skipped, err := putBack(kept, rootfs, old, new)
	if err == nil {
		var more int
		more, err = volumesBack(filepath.Join(images, volumesFile), new)
		skipped += more
	}
	if err != nil {
		return 0, fmt.Errorf("checkpoint %s: putting its files back: %w", name, err)
	}
	return skipped, nil
}

// storeFor copies the node's archive `name` into the claim the container mounts at
// claimMount, if the archive is of the container's namespace, name and image.
func storeFor(bundle string, new *spec, name string) error {
	dir, err := claimDir(bundle)
	if err != nil {
		return err
	}
	if dir == "" {
		return fmt.Errorf("a pod that stores checkpoint %s mounts its session's claim at %s", name, claimMount)
	}
	archive, err := openArchive(name)
	if err != nil {
		return err
	}
	defer archive.Close()
	if _, err := scanFor(archive, new, name); err != nil {
		return err
	}
	return store(archive, dir, new.Annotations[namespaceKey], name)
}

// scanFor scans the archive `name` (writing nothing) and says whether it is of the new
// container's namespace, container name and image.
func scanFor(archive *os.File, new *spec, name string) (*scanned, error) {
	found, err := scan(archive)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", name, err)
	}
	return found, sameOrigin(found.spec, new, name)
}

// sameOrigin says whether the archive's spec is of the new container's namespace,
// container name and image.
func sameOrigin(old, new *spec, name string) error {
	for _, key := range sameAs {
		if old.Annotations[key] != new.Annotations[key] {
			return fmt.Errorf("checkpoint %s is of %s %q, not this container's %q",
				name, key, old.Annotations[key], new.Annotations[key])
		}
	}
	return nil
}

// restore runs `runc restore --detach` with create's options, its stdio the shim's (runc
// maps the process's old stdout and stderr to them: descriptors.json), its pages read
// lazily where the node can (lazy.go). It dies with this program (a timeout of
// containerd's kills it): no restored process containerd disowned.
func restore(runc string, global, rest []string, bundle, images, name string) error {
	work := filepath.Join(bundle, workDir)
	if err := os.MkdirAll(work, 0o700); err != nil {
		return err
	}
	argv := append(append([]string{}, global...), "restore", "--detach",
		"--image-path", images, "--work-path", work, "--bundle", bundle)
	if pid := option(rest, "--pid-file"); pid != "" {
		argv = append(argv, "--pid-file", pid)
	}
	if socket := option(rest, "--console-socket"); socket != "" {
		argv = append(argv, "--console-socket", socket)
	}
	if contains(rest, "--no-pivot") {
		argv = append(argv, "--no-pivot")
	}
	stop, lazy, eager := func() {}, false, argv
	if pid := option(rest, "--pid-file"); pid != "" && lazyPages() {
		// A page server that cannot start costs the wake its speed, not the wake: its
		// pages are then read before the kernel runs, as on a node without one.
		if s, err := serveLazily(images, work, pid); err != nil {
			note(global, "warning", fmt.Sprintf("checkpoint %s: its pages read first: %v", name, err))
		} else {
			stop, lazy = s, true
			argv = append(append([]string{}, argv...), "--lazy-pages")
		}
	}
	err := runRestore(runc, argv, rest)
	if err != nil && lazy && pidIn(option(rest, "--pid-file")) == 0 {
		// Failed for a lazy reason, maybe (the device not handed over, the server gone):
		// the images are as they were, so once more, every page read first.
		stop()
		note(global, "warning", fmt.Sprintf("checkpoint %s: a lazy restore failed (%v): its pages read first", name, err))
		err = runRestore(runc, eager, rest)
	}
	if err != nil {
		stop()
		return fmt.Errorf("runc restore from %s: %v; CRIU said: %s", name, err,
			tail(filepath.Join(work, "restore.log"), 600))
	}
	return nil
}

// runRestore runs runc with `argv` and the container's id, its stdio the shim's.
func runRestore(runc string, argv, rest []string) error {
	cmd := exec.Command(runc, append(argv, rest[len(rest)-1])...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd.Run()
}

// criuConfig has runc give CRIU our options for this container, at its checkpoint and its
// restore: runc reads them from the file its annotation org.criu.config names. A kernel's
// channels are TCP connections from the gateway, which CRIU refuses to dump unless told
// what to do with them: `tcp-close` dumps them as closed and restores them closed (the
// old peers are gone with the old pod; ZMQ's peers connect again). With no connection
// dumped open there is nothing for CRIU's network lock to hold still (iptables rules in
// the pod's namespace, around the dump and the restore): `network-lock skip`, which took
// 0.06 s of a wake's restore.
func criuConfig(bundle string, annotations map[string]string) error {
	if _, set := annotations[criuAnnotation]; set {
		return nil // the pod's own choice, which containerd passed on
	}
	conf := filepath.Join(bundle, criuFile)
	if err := os.WriteFile(conf, []byte("tcp-close\nnetwork-lock skip\n"), 0o600); err != nil {
		return err
	}
	return editSpec(bundle, func(whole map[string]any) error {
		notes, _ := whole["annotations"].(map[string]any)
		if notes == nil {
			notes = map[string]any{}
		}
		notes[criuAnnotation] = conf
		whole["annotations"] = notes
		return nil
	})
}

// rootOf is the host id that a user namespace's mapping gives its root (0: none).
func rootOf(maps []idMap) int {
	for _, m := range maps {
		if m.ContainerID == 0 {
			return m.HostID
		}
	}
	return 0
}

func readJSON(path string, limit int64, into any) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return json.NewDecoder(io.LimitReader(f, limit)).Decode(into)
}

// tail is the end of a file, at most n bytes, on one line.
func tail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return "(no log)"
	}
	defer f.Close()
	if info, err := f.Stat(); err == nil && info.Size() > n {
		f.Seek(info.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(io.LimitReader(f, n))
	return strings.Join(strings.Fields(string(b)), " ")
}
