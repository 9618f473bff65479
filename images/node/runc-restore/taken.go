package main

import (
	"archive/tar"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"
)

// A checkpoint's images kept unpacked beside the kubelet's archive, so that a wake on the
// same node needs no unpacking (a third of a 500 MB resume was spent unpacking):
//
//   - `runc checkpoint` (containerd's, for the kubelet) is run as a child; once it has
//     written the images, they are linked (or copied, on another filesystem) into
//     `$MCPFORGE_RESTORE_DIR/+taken/<token>`, and a file `mcpforge-taken` holding the
//     token is added to the images, which containerd then packs into the archive;
//   - a wake from that archive reads the token (scan) and links the kept images into
//     its own directory instead of unpacking them, if each is there at the archive's
//     size; else it unpacks as before. A wake that spends the archive removes them too.
//
// Only links are kept, never copies: where containerd's temporary directory is on another
// filesystem (a tmpfs /tmp), nothing is kept and wakes unpack. A checkpoint never waits
// for the node's restores: with their lock taken, nothing is kept either. Kept images
// are a second copy of the archive's on the node's disk: they go once an hour old
// (keepFor), or once no archive of the node names them (its session deleted, its
// snapshot dropped, a checkpoint containerd did not finish) and they are takenGrace old,
// at a wake on the node. A wake from a shared archive (forks) unpacks it: the kept images
// are linked into no restore directory whose files are given to a pod's user namespace.
// All is root's, 0700.

const (
	takenFile  = "mcpforge-taken" // in the images, so in the archive's checkpoint/
	takenDir   = "+taken"         // under the restore directory: no container id takes '+'
	takenGrace = 10 * time.Minute // a checkpoint's archive is written within seconds of it
	keepFor    = time.Hour        // then a wake unpacks the archive: the disk is not doubled
)

var tokenPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)

// checkpoint runs `runc checkpoint` with the arguments given, then packs the container's
// emptyDir volumes into its images (volumes.go) and keeps them (keep); a failure to keep
// them only costs the next wake an unpacking. runc's status is this program's.
func checkpoint(runc string, args []string, rest []string) int {
	global, _, _ := split(args)
	if bundle := bundleOf(runc, global, rest); bundle != "" {
		if err := pagesIn(bundle, pagesWait); err != nil {
			fmt.Fprintf(os.Stderr, "mcpforge-runc: %v\n", err)
			return 1
		}
	}
	deadline := time.Now().Add(packFor) // of the kubelet's time for the whole checkpoint
	cmd := exec.Command(runc, args...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Run(); err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return exit.ExitCode()
		}
		fmt.Fprintf(os.Stderr, "mcpforge-runc: %s: %v\n", runc, err)
		return 1
	}
	if images := option(rest, "--image-path"); images != "" {
		global, _, _ := split(args)
		if len(rest) > 0 {
			if err := packVolumes(runc, global, rest[len(rest)-1], images, deadline); err != nil {
				say(global, "warning", fmt.Sprintf("the checkpoint's emptyDir volumes are not packed (a wake from it will fail): %v", err))
				if !exists(filepath.Join(images, volumesFailed)) {
					return 1 // nothing would stop a wake without them: no checkpoint
				}
			}
		}
		if err := keep(images); err != nil {
			fmt.Fprintf(os.Stderr, "mcpforge-runc: the checkpoint's images are not kept: %v\n", err)
		}
		flushSpent() // what keep's sweeps found
	}
	return 0
}

// How long a checkpoint waits for a woken kernel's pages to be in (pagesIn).
var pagesWait = 30 * time.Second // and packFor after it: within the kubelet's 120 s

// pagesIn waits, at most `within`, until no page server writes into the memory of the
// container of `bundle` (lazy.go: it holds a shared lock on the restore's work directory
// while it lives): CRIU dumps only the pages a task has, so a checkpoint taken before
// every page is in would wake on zeros.
func pagesIn(bundle string, within time.Duration) error {
	dir, err := os.Open(filepath.Join(bundle, workDir))
	if err != nil {
		return nil // not woken, or not lazily: nothing to wait for
	}
	defer dir.Close() // and with it the lock
	for end := time.Now().Add(within); ; time.Sleep(20 * time.Millisecond) {
		if syscall.Flock(int(dir.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
			return nil
		}
		if time.Now().After(end) {
			return fmt.Errorf("the kernel's memory is still being read in after its wake (%s): no checkpoint", within)
		}
	}
}

// keep links the regular files of `images` into a directory of their own under the
// restore directory, then names it in the images (takenFile). Under the restores' lock,
// it first sweeps what a handler killed on the node left (kept images no archive names,
// spent files), as a wake does: a node whose sessions are suspended and never woken
// would otherwise keep them.
func keep(images string) error {
	base := env("MCPFORGE_RESTORE_DIR", "/var/lib/mcp-forge/restore")
	// Searchable by the pods' namespaces' roots, as room makes it (the first of the two).
	if err := os.MkdirAll(base, 0o711); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(base, takenDir), 0o700); err != nil {
		return err
	}
	unlock, err := lockRestores(base, false)
	if err != nil || unlock == nil {
		return err // a restore holds the lock: nothing kept (its wake will unpack)
	}
	defer unlock()
	sweepSpent(base) // first: what sweepTaken sets aside now is not found again
	sweepTaken(base)
	raw := make([]byte, 16)
	if _, err := rand.Read(raw); err != nil {
		return err
	}
	token := hex.EncodeToString(raw)
	final := filepath.Join(base, takenDir, token)
	tmp := final + ".tmp"
	if err := os.Mkdir(tmp, 0o700); err != nil {
		return err
	}
	entries, err := os.ReadDir(images)
	if err == nil {
		for _, e := range entries {
			if e.Type().IsRegular() {
				if err = os.Link(filepath.Join(images, e.Name()), filepath.Join(tmp, e.Name())); err != nil {
					break
				}
			}
		}
	}
	if err == nil {
		err = os.Rename(tmp, final)
	}
	if err == nil {
		err = os.WriteFile(filepath.Join(images, takenFile), []byte(token+"\n"), 0o600)
	}
	if err != nil {
		os.RemoveAll(tmp)
		os.RemoveAll(final)
	}
	return err
}

// fromTaken links the kept images of `token` into dir if each of `want` (name: size) is
// there at that size; false (dir as it was) if not.
func fromTaken(token string, want map[string]int64, dir string) bool {
	if !tokenPattern.MatchString(token) || len(want) == 0 {
		return false
	}
	kept := takenPath(token)
	var made []string
	for name, size := range want {
		if name == takenFile {
			continue // the token itself, added after the images were kept
		}
		info, err := os.Lstat(filepath.Join(kept, name))
		if err == nil && info.Mode().IsRegular() && info.Size() == size {
			err = os.Link(filepath.Join(kept, name), filepath.Join(dir, name))
		} else if err == nil {
			err = errors.New("not as the archive has it")
		}
		if err != nil {
			for _, m := range made {
				os.Remove(m)
			}
			return false
		}
		made = append(made, filepath.Join(dir, name))
	}
	return true
}

// takenPath is where the images of `token` are kept ("" for no token).
func takenPath(token string) string {
	if !tokenPattern.MatchString(token) {
		return ""
	}
	return filepath.Join(env("MCPFORGE_RESTORE_DIR", "/var/lib/mcp-forge/restore"), takenDir, token)
}

// tokenOf reads a member's token (takenFile), "" if it is none.
func tokenOf(h *tar.Header, r io.Reader) string {
	if h.Name != "checkpoint/"+takenFile || h.Typeflag != tar.TypeReg || h.Size > 64 {
		return ""
	}
	b, _ := io.ReadAll(io.LimitReader(r, 64))
	return strings.TrimSpace(string(b))
}

// sweepTaken has kept images removed (spent.go) that no archive of the node names any
// more, once takenGrace old (an unfinished keep's too), and any keepFor old. Called with
// the restores' lock held.
func sweepTaken(base string) {
	entries, err := os.ReadDir(filepath.Join(base, takenDir))
	if err != nil {
		return
	}
	var old []string
	for _, e := range entries {
		info, err := e.Info()
		if err == nil && time.Since(info.ModTime()) > keepFor {
			setAside(filepath.Join(base, takenDir, e.Name()))
		} else if err == nil && time.Since(info.ModTime()) > takenGrace {
			old = append(old, e.Name())
		}
	}
	if len(old) == 0 {
		return
	}
	held := map[string]bool{}
	dir := env("MCPFORGE_CHECKPOINTS", "/var/lib/kubelet/checkpoints")
	archives, err := os.ReadDir(dir)
	if err != nil {
		return // nothing is known to be unheld
	}
	for _, a := range archives {
		if !archiveName.MatchString(a.Name()) || !a.Type().IsRegular() {
			continue
		}
		if f, err := openArchive(a.Name()); err == nil {
			members(f, func(h *tar.Header, r io.Reader) error {
				if token := tokenOf(h, r); token != "" {
					held[token] = true
				}
				return nil
			})
			f.Close()
		}
	}
	for _, name := range old {
		if !held[name] {
			setAside(filepath.Join(base, takenDir, name))
		}
	}
}

// lockRestores takes the node's lock of restores (room's), for the caller to release;
// without `wait`, a nil release and no error if another holds it.
func lockRestores(base string, wait bool) (func(), error) {
	lock, err := os.OpenFile(filepath.Join(base, ".lock"), os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	how := syscall.LOCK_EX
	if !wait {
		how |= syscall.LOCK_NB
	}
	if err := syscall.Flock(int(lock.Fd()), how); err != nil {
		lock.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, nil
		}
		return nil, err
	}
	return func() { lock.Close() }, nil
}
