package main

import (
	"archive/tar"
	"bufio"
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
// does for the writable layer containerd packs after it): each volume is read through an
// os.Root at its directory, so no name, link or `..` the kernel made reaches out of it;
// links are packed as links, never followed; what is not a directory, a regular file or a
// link is left out, and so is an entry whose owner the pod does not map. Owners are
// packed as the container's ids (the pod's mounts are idmapped: the disk holds those),
// and written back as the new pod's disk needs them. Both ways are bounded as the
// writable layer's put-back is (rootfsMax bytes, rootfsFilesMax entries, rootfsDepthMax
// names deep, the disk's headroom); a checkpoint whose volumes are past a bound packs
// none (its wake then has what the kernel had open missing, and CRIU fails it: a fresh
// kernel, as before), and says so.
const (
	volumesFile  = "mcpforge-volumes.tar" // in the images, so in the archive's checkpoint/
	emptyDirPath = "/volumes/kubernetes.io~empty-dir/"
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
func packVolumes(runc string, global []string, id, images string) error {
	bundle := bundleOf(runc, global, []string{id})
	if bundle == "" {
		return fmt.Errorf("no bundle for container %q", id)
	}
	var s spec
	err := readJSON(filepath.Join(bundle, askedSpec), maxSpec, &s)
	if errors.Is(err, fs.ErrNotExist) {
		err = readJSON(filepath.Join(bundle, "config.json"), maxSpec, &s)
	}
	if err != nil {
		return err
	}
	return pack(&s, images)
}

// pack writes the spec's emptyDir volumes into images/volumesFile (nothing if it has none).
func pack(s *spec, images string) (err error) {
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
	p := &packer{tw: tar.NewWriter(buf), images: images, budget: rootfsMax}
	for _, m := range dirs {
		if err = p.volume(s, m); err != nil {
			out.Close()
			return err
		}
	}
	if err = p.tw.Close(); err == nil {
		err = buf.Flush()
	}
	if closed := out.Close(); err == nil {
		err = closed
	}
	if err == nil {
		err = os.Rename(tmp, final)
	}
	return err
}

// packer writes volumes' entries into one tar, within the bounds.
type packer struct {
	tw                 *tar.Writer
	images             string
	budget             int64
	entries            int
	written, nextCheck int64
	s                  *spec
	m                  mount
	root               *os.Root
}

func (p *packer) volume(s *spec, m mount) error {
	root, err := os.OpenRoot(m.Source)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // gone with its pod
	}
	if err != nil {
		return err
	}
	defer root.Close()
	p.s, p.m, p.root = s, m, root
	return p.dir(".", relative(m.Destination), 0)
}

// dir packs the entries of the volume's directory `name` (relative to its root) under
// the tar name `as`.
func (p *packer) dir(name, as string, depth int) error {
	if depth >= rootfsDepthMax {
		return fmt.Errorf("a volume's directories are more than %d deep", rootfsDepthMax)
	}
	d, err := p.root.Open(name)
	if err != nil {
		return nil // gone meanwhile, or replaced: the kernel runs
	}
	defer d.Close()
	for {
		batch, err := d.ReadDir(256)
		for _, e := range batch {
			if err := p.entry(path.Join(name, e.Name()), path.Join(as, e.Name()), depth); err != nil {
				return err
			}
		}
		if err == io.EOF || len(batch) == 0 {
			return nil
		}
		if err != nil {
			return nil // the directory went meanwhile
		}
	}
}

func (p *packer) entry(name, as string, depth int) error {
	if p.entries++; p.entries > rootfsFilesMax {
		return fmt.Errorf("the volumes have more than %d entries", rootfsFilesMax)
	}
	info, err := p.root.Lstat(name)
	if err != nil {
		return nil // gone meanwhile
	}
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	uid, okUID := inContainer(int(st.Uid), p.m.UIDMappings, p.s.Linux.UIDMappings)
	gid, okGID := inContainer(int(st.Gid), p.m.GIDMappings, p.s.Linux.GIDMappings)
	if !okUID || !okGID {
		return nil // an owner the pod does not map: left out, with what is under it
	}
	h := &tar.Header{Name: as, Uid: uid, Gid: gid, ModTime: info.ModTime(),
		Mode: int64(info.Mode().Perm()), Format: tar.FormatPAX}
	if info.Mode()&fs.ModeSticky != 0 {
		h.Mode |= 0o1000
	}
	switch {
	case info.IsDir():
		h.Typeflag, h.Name = tar.TypeDir, as+"/"
		if err := p.tw.WriteHeader(h); err != nil {
			return err
		}
		return p.dir(name, as, depth+1)
	case info.Mode().Type() == fs.ModeSymlink:
		target, err := p.root.Readlink(name)
		if err != nil {
			return nil
		}
		h.Typeflag, h.Linkname = tar.TypeSymlink, target
		return p.tw.WriteHeader(h)
	case info.Mode().IsRegular():
		return p.file(name, h)
	}
	return nil // devices, FIFOs, sockets: left out
}

// file packs a regular file at the size it has when opened; one that shrinks meanwhile
// is padded with zeros (the tar stays whole), one that grows is cut.
func (p *packer) file(name string, h *tar.Header) error {
	f, err := p.root.OpenFile(name, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil // gone or replaced meanwhile
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil || !info.Mode().IsRegular() {
		return nil
	}
	h.Typeflag, h.Size = tar.TypeReg, info.Size()
	if p.budget -= h.Size; p.budget < 0 {
		return fmt.Errorf("the volumes hold more than %d bytes", int64(rootfsMax))
	}
	if p.written += h.Size; p.written >= p.nextCheck {
		if err := fits(p.images, h.Size+headroom); err != nil {
			return err
		}
		p.nextCheck = p.written + checkEvery
	}
	if err := p.tw.WriteHeader(h); err != nil {
		return err
	}
	n, err := io.Copy(p.tw, io.LimitReader(f, h.Size))
	if err != nil {
		return err
	}
	_, err = io.CopyN(p.tw, zeros{}, h.Size-n)
	return err
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
	budget := int64(rootfsMax)
	tr := tar.NewReader(bufio.NewReaderSize(in, 1<<20))
	for files := 0; ; files++ {
		h, err := tr.Next()
		if err == io.EOF {
			return skipped, nil
		}
		if err != nil {
			return skipped, fmt.Errorf("its %s: %w", volumesFile, err)
		}
		if files >= rootfsFilesMax {
			return skipped, fmt.Errorf("its %s has more than %d entries", volumesFile, rootfsFilesMax)
		}
		name := relative(h.Name)
		m, ok := volumeOf(name, new)
		inner := strings.TrimPrefix(strings.TrimPrefix(name, relative(m.Destination)), "/")
		if !ok || inner == "" {
			skipped++
			continue
		}
		w := writers[m.Destination]
		if w == nil {
			root, err := os.OpenRoot(m.Source)
			if err != nil {
				return skipped, err
			}
			w = &writer{root: root, budget: budget, owner: owners(m, new)}
			writers[m.Destination] = w
		}
		h.Name = inner
		w.budget = budget
		put, err := w.put(h, tr)
		budget = w.budget
		if errors.Is(err, errBound) {
			return skipped, fmt.Errorf("its %s: %w", volumesFile, err)
		}
		if err != nil || !put {
			skipped++
		}
		if w.written >= w.nextCheck {
			if err := fits(m.Source, headroom); err != nil {
				return skipped, fmt.Errorf("its %s: %w", volumesFile, err)
			}
			w.nextCheck = w.written + checkEvery
		}
	}
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
