package main

import (
	"archive/tar"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"
)

// The container's writable layer as the checkpoint left it, a member of the kubelet's
// archive: containerd's diff of the container's rootfs against its image (gzip, OCI
// whiteouts `.wh.<name>`, owners as the node's disk has them: the old pod's host ids).
// For a volume-less kernel (an ephemeral session) it holds /workspace and /tmp.
const (
	rootfsDiff     = "rootfs-diff.tar"
	rootfsDiffFile = "+rootfs-diff" // where extraction keeps it in the images' room
	rootfsMax      = 16 << 30       // bytes of data put back, whatever the gzip says
	rootfsFilesMax = 1 << 20        // entries
)

// putBack writes the diff kept at diffPath into the new container's rootfs before CRIU
// restores its process (which finds its open files there, of the size it left them).
//
// The diff is the kernel's: what it wrote into its filesystem, under names and links it
// chose. It is written as root on the node, so every name is resolved by an os.Root at
// the container's rootfs: no name, link or `..` reaches out of it (a link whose target
// leaves the rootfs is made, as a link, and never followed; an entry that would be
// written through one is skipped). Owners are moved from the old pod's host ids to the
// new pod's (through the container's own ids). Skipped too: an entry owned by an id
// neither maps (and what is under such a directory), devices and FIFOs, what is under
// proc/, sys/, dev/ or a mount point of the new container (runc mounts there), and a
// mount point's parent that is not a directory; set-id bits are dropped. What is
// written is bounded (rootfsMax bytes of data, holes kept as holes; rootfsFilesMax
// entries; rootfsDepthMax names deep), and stops while the disk still has `headroom`.
// Only a broken gzip or tar, or a bound passed, fails the wake. The count of entries
// skipped is returned.
func putBack(diffPath, rootfs string, old, new *spec) (skipped int, err error) {
	in, err := os.OpenFile(diffPath, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil // the archive has none: nothing to put back
	}
	if err != nil {
		return 0, err
	}
	defer in.Close()
	gz, err := gzip.NewReader(in)
	if err != nil {
		return 0, fmt.Errorf("its %s: %w", rootfsDiff, err)
	}
	root, err := os.OpenRoot(rootfs)
	if err != nil {
		return 0, err
	}
	defer root.Close()
	w := &writer{root: root, layer: true, mounts: mountPoints(new), budget: rootfsMax,
		owner: func(h *tar.Header) (int, int, bool) {
			uid, okUID := moved(h.Uid, old.Linux.UIDMappings, new.Linux.UIDMappings)
			gid, okGID := moved(h.Gid, old.Linux.GIDMappings, new.Linux.GIDMappings)
			return uid, gid, okUID && okGID
		}}
	tr := tar.NewReader(gz)
	err = eachEntry(tr, rootfsDiff, func(h *tar.Header) error {
		put, err := w.put(h, tr)
		if errors.Is(err, errBound) {
			return fmt.Errorf("its %s: %w", rootfsDiff, err)
		}
		if err != nil || !put {
			skipped++ // the rest is put back: a wake keeps the kernel's memory
		}
		if w.written >= w.nextCheck { // the disk of the container's writable layer
			if err := fits(rootfs, headroom); err != nil {
				return fmt.Errorf("its %s: %w", rootfsDiff, err)
			}
			w.nextCheck = w.written + checkEvery
		}
		return nil
	})
	return skipped, err
}

// eachEntry calls each for the entries of tr, in order, at most rootfsFilesMax of them;
// `what` names the tar in the errors.
func eachEntry(tr *tar.Reader, what string, each func(*tar.Header) error) error {
	for files := 0; ; files++ {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("its %s: %w", what, err)
		}
		if files >= rootfsFilesMax {
			return fmt.Errorf("its %s has more than %d entries", what, rootfsFilesMax)
		}
		if err := each(h); err != nil {
			return err
		}
	}
}

var errBound = errors.New("larger than the bound of what is put back")

const (
	rootfsDepthMax = 256      // names in an entry's path
	checkEvery     = 64 << 20 // bytes written between checks of the disk's free space
	zeroRun        = 64 << 10 // a run of zeros this long is left a hole
)

// writer puts a diff's (or a volume's: volumes.go) entries back under root.
type writer struct {
	root               *os.Root
	layer              bool                                      // a writable layer: whiteouts, proc/sys/dev
	owner              func(*tar.Header) (uid, gid int, ok bool) // on the new disk; !ok: skipped
	mounts             []string                                  // the new container's mount points, relative, cleaned
	skippedDirs        []string                                  // directories not put back: nothing under them is
	budget             int64
	written, nextCheck int64
}

// put writes one entry; false if it is of a kind not put back.
func (w *writer) put(h *tar.Header, r io.Reader) (bool, error) {
	name := path.Clean(strings.TrimPrefix(path.Clean("/"+h.Name), "/"))
	if name == "." || name == "" || strings.Count(name, "/") >= rootfsDepthMax {
		return false, nil
	}
	dir, base := path.Split(name)
	if under(name, w.skippedDirs) || (w.layer && under(name, []string{"proc", "sys", "dev"})) {
		return false, nil
	}
	if target, ok := strings.CutPrefix(base, ".wh."); ok && w.layer { // a whiteout: removed
		if target == "" || target == "." || target == ".." || strings.HasPrefix(target, ".wh.") {
			return false, nil // containerd writes no opaque directories
		}
		removed := path.Join(dir, target)
		if under(removed, w.mounts) || above(removed, w.mounts) {
			return false, nil
		}
		return true, w.root.RemoveAll(removed)
	}
	if under(name, w.mounts) || (above(name, w.mounts) && h.Typeflag != tar.TypeDir) {
		return false, nil // runc mounts there: a link in its way is not the kernel's to make
	}
	uid, gid, ok := w.owner(h)
	if !ok {
		if h.Typeflag == tar.TypeDir {
			w.skippedDirs = append(w.skippedDirs, name)
		}
		return false, nil
	}
	if dir != "" {
		if err := w.root.MkdirAll(strings.TrimSuffix(dir, "/"), 0o755); err != nil {
			return false, err
		}
	}
	switch h.Typeflag {
	case tar.TypeDir:
		if info, err := w.root.Lstat(name); err != nil || !info.IsDir() {
			if err := w.root.RemoveAll(name); err != nil {
				return false, err
			}
			if err := w.root.Mkdir(name, 0o700); err != nil {
				return false, err
			}
		}
	case tar.TypeReg:
		if err := w.file(name, h.Size, r); err != nil {
			return false, err
		}
	case tar.TypeSymlink:
		if err := w.root.RemoveAll(name); err != nil {
			return false, err
		}
		if err := w.root.Symlink(h.Linkname, name); err != nil { // made, never followed here
			return false, err
		}
		return true, w.root.Lchown(name, uid, gid)
	case tar.TypeLink:
		if err := w.root.RemoveAll(name); err != nil {
			return false, err
		}
		target := path.Clean(strings.TrimPrefix(path.Clean("/"+h.Linkname), "/"))
		return true, w.root.Link(target, name) // the target's owner and mode stand
	default:
		return false, nil // devices, FIFOs: not put back
	}
	if err := w.root.Lchown(name, uid, gid); err != nil {
		return false, err
	}
	// h.Mode is Unix's bits; FileInfo's mode has them as Go's (sticky: fs.ModeSticky).
	if err := w.root.Chmod(name, h.FileInfo().Mode()&(fs.ModePerm|fs.ModeSticky)); err != nil {
		return false, err
	}
	return true, w.root.Chtimes(name, h.AccessTime, h.ModTime)
}

// file writes a new regular file at name from r's size bytes, its runs of zeros left
// holes (a sparse file in the kernel's layer stays one: containerd's tar holds its
// zeros, compressed a thousand to one).
func (w *writer) file(name string, size int64, r io.Reader) error {
	if err := w.root.RemoveAll(name); err != nil { // a link there is replaced, not followed
		return err
	}
	f, err := w.root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	err = w.copySparse(f, io.LimitReader(r, size))
	if err == nil {
		err = f.Truncate(size)
	}
	if closed := f.Close(); err == nil {
		err = closed
	}
	return err
}

func (w *writer) copySparse(f *os.File, r io.Reader) error {
	buf := make([]byte, zeroRun)
	for {
		n, err := io.ReadFull(r, buf)
		if n > 0 {
			chunk := buf[:n]
			if allZero(chunk) {
				if _, err := f.Seek(int64(n), io.SeekCurrent); err != nil {
					return err
				}
			} else {
				if w.budget -= int64(n); w.budget < 0 {
					return errBound
				}
				w.written += int64(n)
				if _, err := f.Write(chunk); err != nil {
					return err
				}
			}
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// mountPoints are the new container's mount destinations, relative to its rootfs.
func mountPoints(new *spec) []string {
	var out []string
	for _, m := range new.Mounts {
		if d := path.Clean(strings.TrimPrefix(path.Clean("/"+m.Destination), "/")); d != "." {
			out = append(out, d)
		}
	}
	return out
}

// under says whether name is one of dirs or beneath one.
func under(name string, dirs []string) bool {
	for _, d := range dirs {
		if name == d || strings.HasPrefix(name, d+"/") {
			return true
		}
	}
	return false
}

// above says whether name is a parent directory of one of paths.
func above(name string, paths []string) bool {
	for _, p := range paths {
		if strings.HasPrefix(p, name+"/") {
			return true
		}
	}
	return false
}

// moved maps a host id of the old pod to the new pod's host id for the same id in the
// container; false if either mapping lacks it.
func moved(id int, old, new []idMap) (int, bool) {
	for _, m := range old {
		if id >= m.HostID && id < m.HostID+m.Size {
			inside := m.ContainerID + id - m.HostID
			for _, n := range new {
				if inside >= n.ContainerID && inside < n.ContainerID+n.Size {
					return n.HostID + inside - n.ContainerID, true
				}
			}
		}
	}
	return 0, false
}

// rootfsOf is the new container's root directory, as its bundle's config.json names it.
func rootfsOf(bundle string, new *spec) string {
	if filepath.IsAbs(new.Root.Path) {
		return new.Root.Path
	}
	return filepath.Join(bundle, new.Root.Path)
}
