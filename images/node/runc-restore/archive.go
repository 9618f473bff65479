package main

import (
	"archive/tar"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
)

const (
	maxFiles = 10000    // CRIU images in one archive
	headroom = 64 << 20 // free bytes left on the restore directory's disk after extracting
)

// An archive's name as the kubelet makes it: checkpoint-<pod>_<namespace>-<container>-<time>.tar,
// the time in RFC 3339, in the node's zone (`+01:00`) or UTC (`Z`).
var archiveName = regexp.MustCompile(`^checkpoint-[A-Za-z0-9._:+-]{1,400}\.tar$`)

// openArchive opens the archive `name` names, if it is a regular file of the kubelet's
// checkpoint directory (a link there is not followed).
func openArchive(name string) (*os.File, error) {
	if !archiveName.MatchString(name) || strings.Contains(name, "..") {
		return nil, fmt.Errorf("%s=%q is not a checkpoint archive's name", annotation, name)
	}
	path := filepath.Join(env("MCPFORGE_CHECKPOINTS", "/var/lib/kubelet/checkpoints"), name)
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", name, errors.Unwrap(err))
	}
	if info, err := f.Stat(); err != nil || !info.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("checkpoint %s is not a regular file", name)
	}
	return f, nil
}

// scanned is what scan found in an archive, writing nothing.
type scanned struct {
	spec   *spec            // the spec the checkpointed container ran with (spec.dump)
	size   int64            // of its CRIU images
	diff   int64            // of its rootfs-diff.tar (rootfs.go)
	images map[string]int64 // their names and sizes
	token  string           // of its images kept unpacked on this node (taken.go), if any
}

// scan reads the archive's spec.dump and its CRIU images' names and sizes.
func scan(archive *os.File) (*scanned, error) {
	found := &scanned{images: map[string]int64{}}
	err := members(archive, func(h *tar.Header, r io.Reader) error {
		switch base := image(h); {
		case isDiff(h):
			found.diff = h.Size
		case h.Name == "spec.dump":
			found.spec = &spec{}
			if err := json.NewDecoder(io.LimitReader(r, maxSpec)).Decode(found.spec); err != nil {
				return fmt.Errorf("its spec.dump: %w", err)
			}
		case base != "":
			if len(found.images) >= maxFiles {
				return fmt.Errorf("more than %d images", maxFiles)
			}
			if token := tokenOf(h, r); token != "" {
				found.token = token
			}
			found.images[base] = h.Size
			found.size += h.Size
		}
		return nil
	})
	if err == nil && found.spec == nil {
		err = errors.New("it has no spec.dump")
	}
	return found, err
}

// image is the name of a CRIU image the member holds ("" if it is none): a regular file
// directly under checkpoint/.
func image(h *tar.Header) string {
	base, ok := strings.CutPrefix(h.Name, "checkpoint/")
	if !ok || h.Typeflag != tar.TypeReg || base == "" || base == "." || base == ".." ||
		strings.ContainsAny(base, "/\x00") {
		return ""
	}
	return base
}

// members calls each for every member of the archive, from its start.
func members(archive *os.File, each func(*tar.Header, io.Reader) error) error {
	if _, err := archive.Seek(0, io.SeekStart); err != nil {
		return err
	}
	r := tar.NewReader(archive) // it seeks past the members it is not asked to read
	for {
		h, err := r.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := each(h, r); err != nil {
			return err
		}
	}
}

// room is a directory of its own for the container's images, on the restore directory's
// disk, with the node's lock of restores held, and the functions that release the lock
// (unlock: at most once; the images are then in place, so the next wake's room counts
// them) and that remove the directory (done: the lock released first if it is still
// held). One wake's images are put in place at a time on the node (their room checked
// and taken under the lock); CRIU's restores then run side by side.
func room(id string) (dir string, unlock func(), done func(), err error) {
	base := env("MCPFORGE_RESTORE_DIR", "/var/lib/mcp-forge/restore")
	// Searchable by the pods' namespaces' roots, who open some images: readable by none.
	if err := os.MkdirAll(base, 0o711); err != nil {
		return "", nil, nil, err
	}
	release, err := lockRestores(base, true)
	if err != nil {
		return "", nil, nil, err
	}
	sweepSpent(base) // first: what sweepTaken sets aside now is not found again
	sweepTaken(base)
	dir = filepath.Join(base, id)
	var once sync.Once
	unlock = func() { once.Do(release) }
	done = func() {
		unlock()
		setAside(dir) // removed once the wake is done (spent.go); no other wake names it
	}
	if mountsHeld(filepath.Join(base, idmappedDir, id)) { // not killed: running
		unlock() // its room is its own: left as it is
		return "", nil, nil, fmt.Errorf("a restore of container %s is running", id)
	}
	os.RemoveAll(dir) // a restore of this container that was killed
	if err := os.Mkdir(dir, 0o700); err != nil {
		done()
		return "", nil, nil, err
	}
	return dir, unlock, done, nil
}

// extract writes the archive's CRIU images into dir (scan checked them), root's alone
// until they are given (give).
func extract(archive *os.File, dir string) error {
	return members(archive, func(h *tar.Header, r io.Reader) error {
		if isDiff(h) {
			return writeImage(filepath.Join(dir, rootfsDiffFile), io.LimitReader(r, h.Size))
		}
		base := image(h)
		if base == "" {
			return nil
		}
		return writeImage(filepath.Join(dir, base), io.LimitReader(r, h.Size))
	})
}

// extractDiff keeps the archive's rootfs-diff.tar in dir, as extract does.
func extractDiff(archive *os.File, dir string) error {
	return members(archive, func(h *tar.Header, r io.Reader) error {
		if !isDiff(h) {
			return nil
		}
		return writeImage(filepath.Join(dir, rootfsDiffFile), io.LimitReader(r, h.Size))
	})
}

// isDiff says whether the member is the archive's rootfs-diff.tar (rootfs.go).
func isDiff(h *tar.Header) bool {
	return h.Name == rootfsDiff && h.Typeflag == tar.TypeReg && h.Size >= 0
}

// extractStream reads a whole archive from r once, in order (r need not seek): its CRIU
// images written into dir as extract writes them, its spec.dump read. At most `budget`
// bytes are written: a member that says it is larger (a sparse one, say, whose few
// bytes unpack to gigabytes) is refused before anything of it is.
func extractStream(r io.Reader, dir string, budget int64) (*spec, error) {
	tr := tar.NewReader(r) // it reads past what it is not asked for: r sees every byte
	var old *spec
	files := 0
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		switch base := image(h); {
		case isDiff(h):
			if budget -= h.Size; budget < 0 {
				return nil, fmt.Errorf("its %s is larger than the archive", rootfsDiff)
			}
			if err := writeImage(filepath.Join(dir, rootfsDiffFile), io.LimitReader(tr, h.Size)); err != nil {
				return nil, err
			}
		case h.Name == "spec.dump":
			old = &spec{}
			if err := json.NewDecoder(io.LimitReader(tr, maxSpec)).Decode(old); err != nil {
				return nil, fmt.Errorf("its spec.dump: %w", err)
			}
		case base != "":
			if files++; files > maxFiles {
				return nil, fmt.Errorf("more than %d images", maxFiles)
			}
			if budget -= h.Size; h.Size < 0 || budget < 0 {
				return nil, fmt.Errorf("its images are larger than the archive")
			}
			if err := writeImage(filepath.Join(dir, base), io.LimitReader(tr, h.Size)); err != nil {
				return nil, err
			}
		}
	}
	if old == nil {
		return nil, errors.New("it has no spec.dump")
	}
	return old, nil
}

// writeImage writes a new file at path (none may be there, nor a link) from r, root's.
func writeImage(path string, r io.Reader) error {
	out, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, r); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// give hands the images' directory and files (extract's, all regular) to uid:gid.
func give(dir string, uid, gid int) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.Name() == rootfsDiffFile || e.Name() == volumesFile || e.Name() == volumesFailed {
			continue // the handler's to read (files), not CRIU's: root's alone
		}
		if err := os.Lchown(filepath.Join(dir, e.Name()), uid, gid); err != nil {
			return err
		}
	}
	return os.Chown(dir, uid, gid)
}
