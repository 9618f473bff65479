package main

import (
	"archive/tar"
	"bufio"
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
	"time"
)

// A kernel's emptyDir volumes: a sharedGroup session without a persistent workspace has
// volumes (its /shared claim), so its /workspace is an emptyDir on the node's disk and its
// /tmp a memory one. Both end with the pod, and the kubelet's archive holds only the
// container's writable layer. So a checkpoint packs them (packVolumes) into a file of its
// images, which containerd packs into the archive's checkpoint/ with CRIU's (and the
// node keeps, and a claim stores, as it does those), and a wake writes them into the new
// pod's emptyDirs of the same mount points (volumesBack) before CRIU restores the
// process, which finds its open files there.
//
// The packing reads what the kernel wrote, as root on the node, while the kernel may
// still run (the kubelet's checkpoint leaves it running until its pod is removed, as it
// does for the writable layer containerd packs after it). Nothing is resolved by name
// from a volume's root: each entry is looked at and opened through its directory's
// descriptor, never following a link nor opening a FIFO, and packed only if what is open
// is what was looked at (packer). Links are packed as links; what is not a directory, a
// regular file or a link is left out, and so is an entry whose owner the pod does not
// map. Owners are packed as the container's ids (the pod's mounts are idmapped: the disk
// holds those), and written back as the new pod's disk needs them. Both ways are
// bounded as the writable layer's put-back is (rootfsMax bytes, headers counted;
// rootfsFilesMax entries; rootfsDepthMax names deep; the disk's headroom), the packing
// by packFor too. Volumes that cannot be packed make the wake fail (volumesFailed): the
// kernel starts afresh and says why, rather than wake without its files.
const (
	volumesFile   = "mcpforge-volumes.tgz"    // in the images, so in the archive's checkpoint/
	volumesFailed = "mcpforge-volumes.failed" // why they are not: a wake refuses the images
	emptyDirPath  = "/volumes/kubernetes.io~empty-dir/"
)

// emptyDirs are the spec's mounts of the pod's emptyDir volumes.
func emptyDirs(s *spec) []mount {
	var out []mount
	for _, m := range s.Mounts {
		if m.Type == "bind" && filepath.IsAbs(m.Source) && strings.Contains(m.Source, emptyDirPath) &&
			relative(m.Destination) != "." {
			out = append(out, m)
		}
	}
	return out
}

// relative is a mount destination as a clean relative name ("." for the root).
func relative(destination string) string {
	return path.Clean(strings.TrimPrefix(path.Clean("/"+destination), "/"))
}

// packVolumes packs the emptyDir volumes of the container `id` (its spec read from its
// bundle, which `runc state` names: as the kubelet asked for it, for a container this
// program restored, whose mounts' sources idmapped replaced) into images/volumesFile.
// What fails is said in images/volumesFailed too, so that no wake from these images
// goes on without the volumes (wake refuses it, and says why).
func packVolumes(runc string, global []string, id, images string, deadline time.Time) error {
	err := packVolumesOf(runc, global, id, images, deadline)
	if err != nil {
		os.WriteFile(filepath.Join(images, volumesFailed), []byte(err.Error()), 0o600)
	}
	return err
}

func packVolumesOf(runc string, global []string, id, images string, deadline time.Time) error {
	bundle := bundleOf(runc, global, []string{id})
	if bundle == "" {
		return fmt.Errorf("no bundle for container %q", id)
	}
	var s spec
	err := readJSON(filepath.Join(bundle, askedSpec), maxSpec, &s)
	if errors.Is(err, fs.ErrNotExist) {
		if exists(filepath.Join(bundle, marker)) { // its config.json names our mounts
			return fmt.Errorf("container %q was restored, and its kubelet's spec is not kept", id)
		}
		err = readJSON(filepath.Join(bundle, "config.json"), maxSpec, &s)
	}
	if err != nil {
		return err
	}
	return pack(&s, images, deadline)
}

// pack writes the spec's emptyDir volumes into images/volumesFile (nothing if it has
// none), gzipped (a sparse file's zeros cost the disk little), by `deadline`.
func pack(s *spec, images string, deadline time.Time) (err error) {
	dirs := emptyDirs(s)
	if len(dirs) == 0 {
		return nil
	}
	final := filepath.Join(images, volumesFile)
	tmp := final + ".tmp"
	out, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			os.Remove(tmp)
		}
	}()
	buf := bufio.NewWriterSize(out, 1<<20)
	gz, _ := gzip.NewWriterLevel(buf, gzip.BestSpeed)
	p := &packer{tw: tar.NewWriter(gz), images: images, budget: rootfsMax, deadline: deadline}
	for _, m := range dirs {
		if err = p.volume(s, m); err != nil {
			out.Close()
			return err
		}
	}
	if err = p.tw.Close(); err == nil {
		if err = gz.Close(); err == nil {
			err = buf.Flush()
		}
	}
	if closed := out.Close(); err == nil {
		err = closed
	}
	if err == nil {
		err = os.Rename(tmp, final)
	}
	return err
}

const (
	packFor     = 60 * time.Second // from the handler's start (once a woken kernel's pages are in: pagesIn), of the kubelet's 120 s
	tries       = 3                // of a name the kernel replaces while it is packed
	headerBytes = 1536             // a PAX header's cost, beside its names
	dirFlags    = syscall.O_RDONLY | syscall.O_DIRECTORY | syscall.O_NOFOLLOW | syscall.O_NONBLOCK | syscall.O_CLOEXEC
	fileFlags   = syscall.O_RDONLY | syscall.O_NOFOLLOW | syscall.O_NONBLOCK | syscall.O_CLOEXEC
)

// packer writes volumes' entries into one tar, within the bounds. Each entry is looked
// at (fstatat, no link followed) and opened (openat, O_NOFOLLOW|O_NONBLOCK) through its
// directory's descriptor, and packed only if what is open is what was looked at: a
// kernel that swaps a name meanwhile (for a link, a FIFO, another file) has it left out,
// and nothing is resolved by name from the volume's root again.
type packer struct {
	tw                 *tar.Writer
	images             string
	budget             int64
	deadline           time.Time
	entries            int
	written, nextCheck int64
	s                  *spec
	m                  mount
}

func (p *packer) volume(s *spec, m mount) error {
	fd, err := syscall.Open(m.Source, dirFlags, 0) // the kubelet's path: its own
	if errors.Is(err, syscall.ENOENT) {
		return nil // gone with its pod
	}
	if err != nil {
		return fmt.Errorf("volume %s: %w", m.Destination, err)
	}
	p.s, p.m = s, m
	return p.dir(fd, relative(m.Destination), 0)
}

// dir packs the entries of the open directory fd (closed when done) under the tar name `as`.
func (p *packer) dir(fd int, as string, depth int) error {
	d := os.NewFile(uintptr(fd), as)
	defer d.Close()
	if depth >= rootfsDepthMax {
		return fmt.Errorf("a volume's directories are more than %d deep", rootfsDepthMax)
	}
	for {
		batch, err := d.ReadDir(256)
		for _, e := range batch {
			if err := p.entry(fd, e.Name(), path.Join(as, e.Name()), depth); err != nil {
				return err
			}
		}
		if err == io.EOF || (err == nil && len(batch) == 0) {
			return nil // the end (a directory removed meanwhile reads as empty)
		}
		if err != nil {
			return fmt.Errorf("reading %s: %w", as, err)
		}
	}
}

// entry packs the name of the open directory dirfd. A name whose file is replaced
// between the look and the open (a save by rename) is looked at again, `tries` times,
// then the packing fails: a file the kernel has is not left out quietly.
func (p *packer) entry(dirfd int, name, as string, depth int) error {
	if p.entries++; p.entries > rootfsFilesMax {
		return fmt.Errorf("the volumes have more than %d entries", rootfsFilesMax)
	}
	for try := 0; try < tries; try++ {
		if err := p.late(); err != nil {
			return err
		}
		var st syscall.Stat_t
		if !lstatAt(dirfd, name, &st) {
			return nil // gone meanwhile
		}
		if packed, err := p.one(dirfd, name, as, depth, &st); packed || err != nil {
			return err
		}
	}
	return fmt.Errorf("%s kept changing while it was packed", as)
}

func (p *packer) late() error {
	if time.Now().After(p.deadline) {
		return fmt.Errorf("packing the volumes took more than %s", packFor)
	}
	return nil
}

// one packs the entry looked at as st; false if what opens is no longer it.
func (p *packer) one(dirfd int, name, as string, depth int, st *syscall.Stat_t) (bool, error) {
	uid, okUID := inContainer(int(st.Uid), p.m.UIDMappings, p.s.Linux.UIDMappings)
	gid, okGID := inContainer(int(st.Gid), p.m.GIDMappings, p.s.Linux.GIDMappings)
	if !okUID || !okGID {
		return true, nil // an owner the pod does not map: left out, with what is under it
	}
	h := &tar.Header{Name: as, Uid: uid, Gid: gid, Mode: int64(st.Mode & 0o1777),
		ModTime: time.Unix(st.Mtim.Unix()), Format: tar.FormatPAX}
	switch st.Mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		fd, ok := openSame(dirfd, name, dirFlags, st)
		if !ok {
			return false, nil
		}
		h.Typeflag, h.Name = tar.TypeDir, as+"/"
		if err := p.header(h); err != nil {
			syscall.Close(fd)
			return true, err
		}
		return true, p.dir(fd, as, depth+1)
	case syscall.S_IFLNK:
		target, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d/%s", dirfd, name))
		if err != nil {
			return false, nil
		}
		h.Typeflag, h.Linkname = tar.TypeSymlink, target
		return true, p.header(h)
	case syscall.S_IFREG:
		fd, ok := openSame(dirfd, name, fileFlags, st)
		if !ok {
			return false, nil
		}
		f := os.NewFile(uintptr(fd), as)
		defer f.Close()
		return true, p.file(f, h)
	}
	return true, nil // devices, FIFOs, sockets: left out
}

// openSame opens name in dirfd if it is still the file `was` (its device and inode).
func openSame(dirfd int, name string, flags int, was *syscall.Stat_t) (int, bool) {
	fd, err := syscall.Openat(dirfd, name, flags, 0)
	if err != nil {
		return -1, false
	}
	var st syscall.Stat_t
	if syscall.Fstat(fd, &st) != nil || st.Dev != was.Dev || st.Ino != was.Ino ||
		st.Mode&syscall.S_IFMT != was.Mode&syscall.S_IFMT {
		syscall.Close(fd)
		return -1, false
	}
	return fd, true
}

// header writes h, its cost counted as data (names of a million empty entries add up).
func (p *packer) header(h *tar.Header) error {
	if err := p.count(headerBytes + int64(len(h.Name)+len(h.Linkname))); err != nil {
		return err
	}
	return p.tw.WriteHeader(h)
}

// count takes n bytes from the budget, and looks at the disk's free space every
// checkEvery bytes.
func (p *packer) count(n int64) error {
	if p.budget -= n; p.budget < 0 {
		return fmt.Errorf("the volumes hold more than %d bytes", int64(rootfsMax))
	}
	if p.written += n; p.written >= p.nextCheck {
		if err := fits(p.images, n+headroom); err != nil {
			return err
		}
		p.nextCheck = p.written + checkEvery
	}
	return nil
}

// file packs an open regular file at the size it has now; one that shrinks meanwhile is
// padded with zeros (the tar stays whole), one that grows is cut.
func (p *packer) file(f *os.File, h *tar.Header) error {
	info, err := f.Stat()
	if err != nil {
		return nil
	}
	h.Typeflag, h.Size = tar.TypeReg, info.Size()
	if err := p.count(h.Size); err != nil {
		return err
	}
	if err := p.header(h); err != nil {
		return err
	}
	n, err := io.Copy(p.tw, &timed{r: io.LimitReader(f, h.Size), p: p})
	if err != nil {
		return err
	}
	_, err = io.CopyN(p.tw, &timed{r: zeros{}, p: p}, h.Size-n)
	return err
}

// timed reads r while the packing is within its deadline (a sparse file of gigabytes
// reads as long as its zeros).
type timed struct {
	r    io.Reader
	p    *packer
	read int64
}

func (t *timed) Read(b []byte) (int, error) {
	if t.read += int64(len(b)); t.read >= 8<<20 {
		t.read = 0
		if err := t.p.late(); err != nil {
			return 0, err
		}
	}
	return t.r.Read(b)
}

const oPath = 0x200000 // O_PATH: the file itself, a link too, neither opened nor followed

// lstatAt is fstatat(dirfd, name, AT_SYMLINK_NOFOLLOW), through an O_PATH descriptor
// (Go's syscall has no fstatat on every architecture); a FIFO is not opened so.
func lstatAt(dirfd int, name string, st *syscall.Stat_t) bool {
	fd, err := syscall.Openat(dirfd, name, oPath|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer syscall.Close(fd)
	return syscall.Fstat(fd, st) == nil
}

type zeros struct{}

func (zeros) Read(b []byte) (int, error) {
	clear(b)
	return len(b), nil
}

// inContainer is the container's id of an id on a volume's disk: through the mount's
// idmapping to the host's id (none: the disk holds host ids), then the pod's mapping
// (none: no user namespace, the host's ids are the container's).
func inContainer(id int, mountMaps, podMaps []idMap) (int, bool) {
	host, ok := mapped(id, mountMaps, true)
	if !ok {
		return 0, false
	}
	return mapped(host, podMaps, false)
}

// onDisk is the reverse: the id a new volume's disk holds for a container's id.
func onDisk(id int, mountMaps, podMaps []idMap) (int, bool) {
	host, ok := mapped(id, podMaps, true)
	if !ok {
		return 0, false
	}
	return mapped(host, mountMaps, false)
}

// mapped maps id from container to host ids (toHost) or back; no maps: the same id.
func mapped(id int, maps []idMap, toHost bool) (int, bool) {
	if len(maps) == 0 {
		return id, true
	}
	for _, m := range maps {
		from, to := m.ContainerID, m.HostID
		if !toHost {
			from, to = to, from
		}
		if id >= from && id < from+m.Size {
			return to + id - from, true
		}
	}
	return 0, false
}

// volumesBack writes the volumes a checkpoint packed (kept at packed) into the new
// container's emptyDirs of the same mount points, through an os.Root at each, as the
// writable layer is put back (rootfs.go: links made and never followed, set-id bits
// dropped, holes kept, bounded); an entry of a mount point the new container has no
// emptyDir at is skipped. The count of entries skipped is returned.
func volumesBack(packed string, new *spec) (skipped int, err error) {
	if why, err := os.ReadFile(filepath.Join(filepath.Dir(packed), volumesFailed)); err == nil {
		return 0, fmt.Errorf("its emptyDir volumes were not packed: %.300s", why)
	}
	in, err := os.OpenFile(packed, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil // none packed
	}
	if err != nil {
		return 0, err
	}
	defer in.Close()
	writers := map[string]*writer{}
	defer func() {
		for _, w := range writers {
			w.root.Close()
		}
	}()
	gz, err := gzip.NewReader(bufio.NewReaderSize(in, 1<<20))
	if err != nil {
		return 0, fmt.Errorf("its %s: %w", volumesFile, err)
	}
	budget := int64(rootfsMax)
	tr := tar.NewReader(gz)
	err = eachEntry(tr, volumesFile, func(h *tar.Header) error {
		name := relative(h.Name)
		m, ok := volumeOf(name, new)
		inner := strings.TrimPrefix(strings.TrimPrefix(name, relative(m.Destination)), "/")
		if !ok || inner == "" {
			skipped++
			return nil
		}
		w := writers[m.Destination]
		if w == nil {
			root, err := os.OpenRoot(m.Source)
			if err != nil {
				return err
			}
			w = &writer{root: root, budget: budget, owner: owners(m, new), mounts: within(m, new)}
			writers[m.Destination] = w
		}
		// Room for each file: the node's disk keeps its headroom, a memory volume (the
		// /tmp of 256 MiB) none, as it held the file before.
		if h.Typeflag == tar.TypeReg {
			if err := fits(m.Source, h.Size+margin(m.Source)); err != nil {
				return fmt.Errorf("its %s: %w", volumesFile, err)
			}
		}
		h.Name = inner
		w.budget = budget
		put, err := w.put(h, tr)
		budget = w.budget
		if errors.Is(err, errBound) {
			return fmt.Errorf("its %s: %w", volumesFile, err)
		}
		if err != nil || !put {
			skipped++
		}
		return nil
	})
	return skipped, err
}

// margin is what a volume's filesystem keeps free as files are written back: the
// headroom of the node's disk, none on a tmpfs (a memory emptyDir of its own size).
func margin(dir string) int64 {
	var fs syscall.Statfs_t
	if syscall.Statfs(dir, &fs) == nil && fs.Type == tmpfsMagic {
		return 0
	}
	return headroom
}

const tmpfsMagic = 0x01021994

// within are the new container's mount points under the volume m's, relative to it: a
// link the kernel left in their way is not put back (runc mounts there).
func within(m mount, new *spec) []string {
	d := relative(m.Destination)
	var out []string
	for _, p := range mountPoints(new) {
		if inner, ok := strings.CutPrefix(p, d+"/"); ok {
			out = append(out, inner)
		}
	}
	return out
}

// volumeOf is the new container's emptyDir mount that holds the entry `name` (its
// deepest, if they nest).
func volumeOf(name string, new *spec) (mount, bool) {
	var found mount
	ok := false
	for _, m := range emptyDirs(new) {
		d := relative(m.Destination)
		if (name == d || strings.HasPrefix(name, d+"/")) && (!ok || len(d) > len(relative(found.Destination))) {
			found, ok = m, true
		}
	}
	return found, ok
}

// owners turns a packed entry's owner (the container's ids) into the new volume's disk's.
func owners(m mount, new *spec) func(*tar.Header) (int, int, bool) {
	return func(h *tar.Header) (int, int, bool) {
		uid, okUID := onDisk(h.Uid, m.UIDMappings, new.Linux.UIDMappings)
		gid, okGID := onDisk(h.Gid, m.GIDMappings, new.Linux.GIDMappings)
		return uid, gid, okUID && okGID
	}
}
