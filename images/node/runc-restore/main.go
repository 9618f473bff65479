// mcpforge-runc: the runc of a node's `mcpforge-restore` runtime handler.
//
// containerd 2.4 no longer restores a container from a checkpoint at CreateContainer
// (docs/design.md §14), so a pod that is to wake from a kubelet checkpoint runs on this
// handler instead. Every call is passed to runc as it is, except three:
//
//   - `create` of a pod's container (not its sandbox): runc is told our CRIU options
//     (criuConfig). If the spec carries the annotation mcpforge.dev/restore-from
//     (containerd passes it with the handler's pod_annotations) and the container is
//     starting for the first time, the value names a checkpoint archive the kubelet
//     wrote (a file name, no directory) under MCPFORGE_CHECKPOINTS. The archive must be
//     of the same namespace, container name and image as the new container, and the pod
//     must have a user namespace of its own. Its CRIU images are extracted to disk,
//     given to the pod's user namespace's root (who opens some of them), and
//     `runc restore --detach` brings the process back in the new container (restore.go).
//     The archive is then spent, whether the restore worked or not: a checkpoint wakes
//     one pod, once (taken out of use at once, removed by a process of its own after the
//     wake: spent.go). A value of `shared:<archive>` (forks made together, which wake from
//     one checkpoint) leaves it for the node's sweeper, which removes what no session holds.
//     With no archive of that name on the node, the copy in the session's claim (mounted
//     at /.mcpforge-snapshot) is woken from if its HMAC is the nodes' (store.go); a value
//     of `store:<archive>` has the archive copied into that claim instead, and the
//     container made as any other (the operator's store pod).
//   - `start` of a container restored so: it runs already; nothing to do.
//   - `checkpoint`: run as a child, its images then kept unpacked beside the archive
//     containerd makes of them, which a wake on this node links instead of unpacking
//     (taken.go).
//
// A refusal or a failed restore is written to runc's log, which containerd reports in the
// pod's status ("failed to create containerd task: ... mcpforge-runc: ...").
//
// Settings come from the environment (containerd's, or a wrapper script's):
// MCPFORGE_RUNC, the runc to run (/usr/sbin/runc); MCPFORGE_CHECKPOINTS, the kubelet's
// checkpoint directory (/var/lib/kubelet/checkpoints); MCPFORGE_RESTORE_DIR, where
// images are extracted, on disk (/var/lib/mcp-forge/restore); MCPFORGE_SNAPSHOT_KEY, the
// key the nodes sign stored snapshots with (/etc/mcp-forge/snapshot.key).
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"
)

// Flags of runc's that come before the command and take no value.
var boolFlags = map[string]bool{"--debug": true, "--systemd-cgroup": true}

func main() {
	// A child's parent-death signal is the forking thread's: runc restore is started from
	// this one, which never ends before the program does (restore.go).
	runtime.LockOSThread()
	if len(os.Args) > 1 && os.Args[1] == removeFlag {
		removeLater(os.Args[2:]) // what a wake spent (spent.go)
		return
	}
	if len(os.Args) > 1 && os.Args[1] == lazyFlag {
		lazyServe(os.Args[2:]) // a wake's page server (lazy.go)
		return
	}
	runc := env("MCPFORGE_RUNC", "/usr/sbin/runc")
	args := os.Args[1:]
	global, cmd, rest := split(args)
	switch cmd {
	case "create":
		restored, err := create(runc, global, rest)
		if err != nil {
			fail(global, err)
		}
		if restored {
			return
		}
	case "checkpoint":
		os.Exit(checkpoint(runc, args, rest)) // its images kept unpacked (taken.go)
	case "start":
		if bundle := bundleOf(runc, global, rest); bundle != "" && exists(filepath.Join(bundle, marker)) {
			return // restored: it runs already
		}
	}
	if err := syscall.Exec(runc, append([]string{runc}, args...), os.Environ()); err != nil {
		fail(global, fmt.Errorf("exec %s: %w", runc, err))
	}
}

// split parts runc's arguments into its global flags, the command, and the command's own.
func split(args []string) (global []string, cmd string, rest []string) {
	i := 0
	for i < len(args) && strings.HasPrefix(args[i], "-") {
		if strings.Contains(args[i], "=") || boolFlags[args[i]] {
			i++
		} else {
			i += 2
		}
	}
	if i >= len(args) {
		return args, "", nil
	}
	return args[:i], args[i], args[i+1:]
}

// option is the value of `--name V` or `--name=V` among args ("" if absent).
func option(args []string, name string) string {
	for i, a := range args {
		if a == name && i+1 < len(args) {
			return args[i+1]
		}
		if strings.HasPrefix(a, name+"=") {
			return strings.TrimPrefix(a, name+"=")
		}
	}
	return ""
}

// bundleOf is the bundle of the container `start` names, from `runc state` ("" if none).
func bundleOf(runc string, global, rest []string) string {
	if len(rest) == 0 {
		return ""
	}
	out, err := exec.Command(runc, append(append([]string{}, global...), "state", rest[len(rest)-1])...).Output()
	if err != nil {
		return ""
	}
	var state struct {
		Bundle string `json:"bundle"`
	}
	if json.Unmarshal(out, &state) != nil {
		return ""
	}
	return state.Bundle
}

// fail says err in runc's log, where containerd reads a failed command's reason, and on
// stderr, and exits 1.
func fail(global []string, err error) {
	say(global, "error", err.Error())
	os.Exit(1)
}

// say writes a line of runc's log (and stderr): what a command that did not fail has to
// say is kept there, where containerd does not read it.
func say(global []string, level, text string) {
	note(global, level, text)
	fmt.Fprintln(os.Stderr, "mcpforge-runc: "+text)
}

// note writes a line of runc's log only: the stderr of a `create` that goes on is the
// container's own (its log, which a kernel's readers read), not ours.
func note(global []string, level, text string) {
	if log := option(global, "--log"); log != "" {
		line, _ := json.Marshal(map[string]string{
			"level": level, "msg": "mcpforge-runc: " + text, "time": time.Now().UTC().Format(time.RFC3339Nano),
		})
		if f, e := os.OpenFile(log, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600); e == nil {
			f.Write(append(line, '\n'))
			f.Close()
		}
	}
}

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func contains(args []string, a string) bool {
	for _, x := range args {
		if x == a {
			return true
		}
	}
	return false
}
