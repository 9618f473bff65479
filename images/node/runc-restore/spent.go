package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// What a wake spends (its archive, its kept images, its restore directory) is removed by a
// process of its own, once the wake is done: freeing a 500 MB file's blocks takes a tenth
// of a second, which the woken container need not wait for. This program, run with
// removeFlag first, is that process; it is not waited for (containerd's shim, a
// subreaper, reaps it). One that did not run leaves what the next sweep removes
// (sweepTaken: spent directories, kept images; the node's sweeper: archives).

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
		if cmd.Start() == nil {
			return
		}
	}
	removeNow(spent)
}

// removeNow removes each absolute path given (a directory with what it holds; a link
// itself, never its target).
func removeNow(paths []string) {
	for _, p := range paths {
		if filepath.IsAbs(p) && filepath.Clean(p) != "/" {
			if err := os.RemoveAll(p); err != nil {
				fmt.Fprintf(os.Stderr, "mcpforge-runc: %v\n", err)
			}
		}
	}
}

// setAside renames a restore directory out of its container's name (at once), to be
// removed later; removed here if it cannot be renamed.
func setAside(dir string) {
	aside := filepath.Join(filepath.Dir(dir), spentPrefix+filepath.Base(dir))
	if err := os.Rename(dir, aside); err != nil {
		os.RemoveAll(dir)
		return
	}
	spend(aside)
}

// sweepSpent removes spent restore directories a remover left (it was killed), once a
// minute old. Called with the restores' lock held.
func sweepSpent(base string) {
	entries, err := os.ReadDir(base)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), spentPrefix) {
			continue
		}
		if info, err := e.Info(); err == nil && time.Since(info.ModTime()) > time.Minute {
			os.RemoveAll(filepath.Join(base, e.Name()))
		}
	}
}
