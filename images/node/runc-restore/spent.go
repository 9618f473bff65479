package main

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// What a wake spends (its archive, its kept images, its restore directory, a claim's copy)
// is taken out of use at once, under the node's lock (renamed out of its name), and
// removed by a process of its own once the wake is done: freeing a 500 MB file's blocks
// takes a tenth of a second, which the woken container need not wait for. This program,
// run with removeFlag first, is that process; it is not waited for (containerd's shim,
// a subreaper, reaps it). What one that did not run left is removed at the next wake or
// checkpoint on the node (sweepSpent).
//
// Nor need the wake's first seconds share the node's cores with it: the woken kernel's
// first answers, the kubelet's status of the pod, the operator's look at it. So the
// remover takes the lowest CPU and I/O priorities and starts removeAfter after the wake
// (a 500 MB kernel's wake, alternating on the test node, six each: 0.99 s where 1.14 s,
// the removal of its 1 GB of archive and images at once beside it).

// How long after a wake what it spent is removed (removeLater).
var removeAfter = 3 * time.Second

const (
	removeFlag  = "--mcpforge-remove"
	spentPrefix = "+spent-" // a restore directory done with, under the restore directory
)

var spent []string

// spend marks path to be removed once this program's work is done (flushSpent).
func spend(path string) {
	if path != "" {
		spent = append(spent, path)
	}
}

// flushSpent has what was spent removed by a detached process, or here if none starts.
func flushSpent() {
	if len(spent) == 0 {
		return
	}
	if self, err := os.Executable(); err == nil {
		cmd := exec.Command(self, append([]string{removeFlag}, spent...)...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		cmd.Dir = "/"
		if cmd.Start() == nil {
			return
		}
	}
	removeNow(spent, false) // what a page server holds is left to the next sweep
}

// removeLater is the remover's work: what the wake spent, removed removeAfter later, at
// the lowest priorities (nice 19; I/O best-effort, level 7), this thread's: main keeps
// to it.
func removeLater(paths []string) {
	syscall.Setpriority(syscall.PRIO_PROCESS, 0, 19)
	syscall.Syscall(syscall.SYS_IOPRIO_SET, ioprioWhoProcess, 0, ioprioBestEffort<<ioprioClassShift|7)
	time.Sleep(removeAfter)                  // not a wait for an event: the wake's first seconds go first
	removeNow(removeNow(paths, false), true) // what a page server still reads, last
}

const (
	ioprioWhoProcess = 1 // linux/ioprio.h
	ioprioClassShift = 13
	ioprioBestEffort = 2
)

// removeNow removes each absolute path given that setAside named (a directory a page
// server still reads: waited for with `wait`, else left and said, `held`): a directory of the
// restore directory's with what it holds, anything else itself (a link, never its
// target; a directory a pod made in its claim, not at all).
func removeNow(paths []string, wait bool) (held []string) {
	for _, p := range paths {
		if !filepath.IsAbs(p) || !strings.HasPrefix(filepath.Base(p), spentPrefix) {
			continue
		}
		base := env("MCPFORGE_RESTORE_DIR", "/var/lib/mcp-forge/restore")
		parent := filepath.Dir(p)
		ours := parent == base || parent == filepath.Join(base, takenDir)
		var err error
		if info, lerr := os.Lstat(p); lerr == nil && info.IsDir() && ours {
			var free bool
			if free, err = removeUnheld(p, wait); err == nil && !free {
				held = append(held, p)
			}
		} else {
			err = os.Remove(p) // a claim's copy: a file, never what a pod made of it
		}
		if err != nil && !os.IsNotExist(err) {
			fmt.Fprintf(os.Stderr, "mcpforge-runc: %v\n", err)
		}
	}
	return held
}

// removeUnheld removes a directory of ours once no page server holds it (lazy.go):
// waiting for it with `wait`, else leaving it (false) to a later removal.
func removeUnheld(dir string, wait bool) (bool, error) {
	if f, err := os.Open(dir); err == nil {
		defer f.Close() // and with it the lock
		how := syscall.LOCK_EX
		if !wait {
			how |= syscall.LOCK_NB
		}
		if err := syscall.Flock(int(f.Fd()), how); err != nil {
			return false, nil
		}
	}
	return true, os.RemoveAll(dir)
}

// heldNow: is dir a directory a page server holds (lazy.go) at this moment?
func heldNow(dir string) bool {
	f, err := os.Open(dir)
	if err != nil {
		return false
	}
	defer f.Close()
	if info, err := f.Stat(); err != nil || !info.IsDir() {
		return false
	}
	if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
		return true
	}
	syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	return false
}

// setAside renames path out of its name at once (so nothing takes it again: another wake
// of the same archive, say) to be removed later (flushSpent); a file of a pod's (a
// claim's copy) is unlinked, a directory of ours removed, if it cannot be renamed.
func setAside(path string) {
	if _, err := os.Lstat(path); err != nil {
		return
	}
	raw := make([]byte, 4)
	rand.Read(raw)
	aside := filepath.Join(filepath.Dir(path), spentPrefix+hex.EncodeToString(raw)+"-"+filepath.Base(path))
	if err := os.Rename(path, aside); err != nil {
		if os.Remove(path) != nil && strings.HasPrefix(filepath.Base(filepath.Dir(path)), "+") {
			os.RemoveAll(path) // ours, under +taken
		}
		return
	}
	spend(aside)
}

// sweepSpent has what a remover left (it was killed) removed, once a minute old: set
// aside in the restore directory, its +taken, or the kubelet's checkpoint directory.
// Called with the restores' lock held.
func sweepSpent(base string) {
	dirs := []string{base, filepath.Join(base, takenDir), env("MCPFORGE_CHECKPOINTS", "/var/lib/kubelet/checkpoints")}
	for _, dir := range dirs {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range entries {
			if !strings.HasPrefix(e.Name(), spentPrefix) {
				continue
			}
			path := filepath.Join(dir, e.Name())
			// One a page server still holds is left: a remover would wait on it for as
			// long, and each wake would start another.
			if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > time.Minute && !heldNow(path) {
				spend(path)
			}
		}
	}
}
