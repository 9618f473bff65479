package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"unsafe"
)

// A pod with a user namespace of its own (hostUsers: false) has its volumes mounted
// idmapped: its uid 1000 writes files that are 1000's on the node's disk, whatever range
// the pod's namespace maps. runc's restore does not do so: it has CRIU mount a bind
// mount's source as it is (its uidMappings unused), so a woken kernel saw its persistent
// workspace as nobody's and could not open its own working directory. idmapped makes
// each such source an idmapped mount first, in the user namespace the new container
// joins (its sandbox's), and has runc mount that instead.

const (
	idmappedDir = "+idmapped"            // under the restore directory: no container id takes '+'
	askedSpec   = "mcpforge-config.json" // in the bundle: its config.json before idmapped's edit
)

// Linux's mount API (the same numbers on every architecture since 5.2 and 5.12).
const (
	sysOpenTree     = 428
	sysMoveMount    = 429
	sysMountSetattr = 442

	openTreeClone       = 0x1
	atRecursive         = 0x8000
	atEmptyPath         = 0x1000
	moveMountFEmptyPath = 0x4
	mountAttrIdmap      = 0x00100000
	mountAttrSize       = 32
)

type mountAttr struct {
	AttrSet     uint64
	AttrClr     uint64
	Propagation uint64
	UsernsFd    uint64
}

// idmapped rewrites the bundle's config.json so that each bind mount runc would idmap is
// one already, mounted under dir (outside the bundle, which containerd removes whole:
// a mount left in it would have the volume's files removed with it); undo unmounts them
// (the restored container holds mounts of its own), and is to be called whatever the
// restore did. While they are mounted, dir's lock file (dir + ".lock") is held: restores
// run side by side (room), and what a killed handler left in dir's parent, whose lock
// nobody holds, is unmounted first.
func idmapped(bundle, dir string) (undo func(), err error) {
	unmountStale(filepath.Dir(dir))
	held, err := holdMounts(dir)
	if err != nil {
		return func() {}, err
	}
	var made []string
	undo = func() {
		for _, target := range made {
			_ = syscall.Unmount(target, syscall.MNT_DETACH)
			_ = os.Remove(target)
		}
		_ = os.Remove(dir)
		_ = os.Remove(dir + ".lock")
		held.Close()
	}
	// The mounts as the kubelet asked for them, for the restored container's next
	// checkpoint, which packs its emptyDirs from their sources (volumes.go).
	if raw, err := os.ReadFile(filepath.Join(bundle, "config.json")); err == nil {
		_ = os.WriteFile(filepath.Join(bundle, askedSpec), raw, 0o600)
	}
	err = editSpec(bundle, func(whole map[string]any) error {
		userns := usernsPath(whole)
		mounts, _ := whole["mounts"].([]any)
		for i, item := range mounts {
			m, _ := item.(map[string]any)
			if m == nil || m["type"] != "bind" || m["uidMappings"] == nil {
				continue
			}
			if userns == "" {
				return fmt.Errorf("mount %v is idmapped, but the container joins no user namespace", m["destination"])
			}
			source, _ := m["source"].(string)
			options := optionsOf(m)
			target := filepath.Join(dir, fmt.Sprintf("%d", i))
			if err := idmap(source, target, userns, options["rbind"], options["ridmap"]); err != nil {
				return fmt.Errorf("idmapped mount of %v: %w", m["destination"], err)
			}
			made = append(made, target)
			m["source"] = target
			delete(m, "uidMappings")
			delete(m, "gidMappings")
			if list, ok := m["options"].([]any); ok {
				kept := []any{}
				for _, o := range list {
					if o != "idmap" && o != "ridmap" {
						kept = append(kept, o)
					}
				}
				m["options"] = kept
			}
		}
		return nil
	})
	if err != nil {
		undo()
		return func() {}, err
	}
	return undo, nil
}

// optionsOf is the set of a mount's options.
func optionsOf(m map[string]any) map[string]bool {
	set := map[string]bool{}
	list, _ := m["options"].([]any)
	for _, o := range list {
		if s, ok := o.(string); ok {
			set[s] = true
		}
	}
	return set
}

// holdMounts takes the lock of the mounts a restore makes in dir (dir + ".lock"), for as
// long as the returned file is open (mountsHeld says whether one holds it).
func holdMounts(dir string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(dir+".lock", os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("the idmapped mounts of %s are another restore's: %w", dir, err)
	}
	return f, nil
}

// mountsHeld says whether a running restore holds the lock of the mounts in dir.
func mountsHeld(dir string) bool {
	f, err := os.OpenFile(dir+".lock", os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	return syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil
}

// unmountStale unmounts and removes what killed handlers left under root (one directory
// per container, one mount point per mount; its lock file beside it), skipping what a
// running restore holds (its lock); never removes a tree.
func unmountStale(root string) {
	dirs, _ := os.ReadDir(root)
	for _, d := range dirs {
		name, isLock := d.Name(), false
		if !d.IsDir() {
			name, isLock = strings.CutSuffix(name, ".lock")
			if !isLock {
				continue
			}
		}
		dir := filepath.Join(root, name)
		lock, err := os.OpenFile(dir+".lock", os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			continue
		}
		if syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) != nil {
			lock.Close() // a restore runs with them
			continue
		}
		points, _ := os.ReadDir(dir)
		for _, p := range points {
			point := filepath.Join(dir, p.Name())
			_ = syscall.Unmount(point, syscall.MNT_DETACH)
			_ = os.Remove(point) // an empty directory or file once unmounted; else kept
		}
		_ = os.Remove(dir)
		if _, err := os.Lstat(dir); os.IsNotExist(err) {
			_ = os.Remove(dir + ".lock")
		}
		lock.Close()
	}
}

// usernsPath is the user namespace the container joins ("" if none named).
func usernsPath(whole map[string]any) string {
	linux, _ := whole["linux"].(map[string]any)
	namespaces, _ := linux["namespaces"].([]any)
	for _, item := range namespaces {
		ns, _ := item.(map[string]any)
		if ns != nil && ns["type"] == "user" {
			path, _ := ns["path"].(string)
			return path
		}
	}
	return ""
}

// idmap mounts a clone of source at target (made: a file for a file), idmapped as the
// user namespace at usernsPath maps ids: its submounts too if `recursive` (rbind), and
// idmapped too if `ridmap`, as runc mounts it.
func idmap(source, target, usernsPath string, recursive, ridmap bool) error {
	info, err := os.Stat(source)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o700); err != nil { // root's alone
		return err
	}
	if info.IsDir() {
		err = os.Mkdir(target, 0o700)
	} else {
		err = os.WriteFile(target, nil, 0o600)
	}
	if err != nil {
		return err
	}
	userns, err := os.Open(usernsPath)
	if err != nil {
		return err
	}
	defer userns.Close()
	src, err := pathPtr(source)
	if err != nil {
		return err
	}
	clone, setattr := openTreeClone|syscall.O_CLOEXEC, atEmptyPath
	if recursive {
		clone |= atRecursive
	}
	if ridmap {
		setattr |= atRecursive
	}
	r, _, errno := syscall.Syscall(sysOpenTree, uintptr(atFdcwd), uintptr(unsafe.Pointer(src)),
		uintptr(clone))
	if errno != 0 {
		return fmt.Errorf("open_tree: %w", errno)
	}
	tree := int(r)
	defer syscall.Close(tree)
	attr := mountAttr{AttrSet: mountAttrIdmap, UsernsFd: uint64(userns.Fd())}
	empty, _ := pathPtr("")
	if _, _, errno := syscall.Syscall6(sysMountSetattr, uintptr(tree), uintptr(unsafe.Pointer(empty)),
		uintptr(setattr), uintptr(unsafe.Pointer(&attr)), mountAttrSize, 0); errno != 0 {
		return fmt.Errorf("mount_setattr: %w", errno)
	}
	dst, err := pathPtr(target)
	if err != nil {
		return err
	}
	if _, _, errno := syscall.Syscall6(sysMoveMount, uintptr(tree), uintptr(unsafe.Pointer(empty)),
		uintptr(atFdcwd), uintptr(unsafe.Pointer(dst)), moveMountFEmptyPath, 0); errno != 0 {
		return fmt.Errorf("move_mount: %w", errno)
	}
	return nil
}

var atFdcwd = -100 // AT_FDCWD, a variable: a negative constant is no uintptr

func pathPtr(path string) (*byte, error) {
	return syscall.BytePtrFromString(path)
}

// editSpec rewrites the bundle's config.json through edit, keeping what it does not know.
func editSpec(bundle string, edit func(map[string]any) error) error {
	path := filepath.Join(bundle, "config.json")
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var whole map[string]any
	if err := json.Unmarshal(raw, &whole); err != nil {
		return err
	}
	if err := edit(whole); err != nil {
		return err
	}
	out, err := json.Marshal(whole)
	if err != nil {
		return err
	}
	tmp := path + ".mcpforge"
	if err := os.WriteFile(tmp, out, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
