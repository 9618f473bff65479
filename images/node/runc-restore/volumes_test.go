package main

import (
	"archive/tar"
	"compress/gzip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// podWithVolumes is a pod's spec (its user namespace from `host`) with emptyDirs at
// /workspace and /tmp and a claim at /shared, under base; idmapped: mounts as the
// kubelet makes them for a pod with a user namespace (the disk holds container ids).
func podWithVolumes(t *testing.T, base string, host int, idmapped bool) *spec {
	s := podSpec(host)
	var maps []idMap
	if idmapped {
		maps = s.Linux.UIDMappings
	}
	for _, v := range []struct{ dest, source string }{
		{"/workspace", "pods/u/volumes/kubernetes.io~empty-dir/workspace"},
		{"/tmp", "pods/u/volumes/kubernetes.io~empty-dir/tmp"},
		{"/shared", "pods/u/volumes/kubernetes.io~csi/shared/mount"},
	} {
		source := filepath.Join(base, v.source)
		if err := os.MkdirAll(source, 0o777); err != nil {
			t.Fatal(err)
		}
		s.Mounts = append(s.Mounts, mount{Destination: v.dest, Source: source, Type: "bind",
			UIDMappings: maps, GIDMappings: maps})
	}
	return s
}

func write(t *testing.T, path, body string, uid int) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(body), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Lchown(path, uid, uid); err != nil {
		t.Fatal(err)
	}
}

func TestEmptyDirVolumesComeBackInTheNewPodsOwnedAsTheKernelLeftThem(t *testing.T) {
	for _, idmapped := range []bool{true, false} {
		images, oldBase, newBase := t.TempDir(), t.TempDir(), t.TempDir()
		old := podWithVolumes(t, oldBase, oldHost, idmapped)
		new := podWithVolumes(t, newBase, newHost, idmapped)
		disk := func(host, id int) int { // what a volume's disk holds for the container's id
			if idmapped {
				return id
			}
			return host + id
		}
		ws, tmp, shared := old.Mounts[0].Source, old.Mounts[1].Source, old.Mounts[2].Source
		write(t, filepath.Join(ws, "log.txt"), "ab", disk(oldHost, 1000))
		write(t, filepath.Join(ws, "d/e/f"), "deep", disk(oldHost, 1000))
		for _, d := range []string{"d", "d/e"} {
			os.Lchown(filepath.Join(ws, d), disk(oldHost, 1000), disk(oldHost, 1000))
		}
		write(t, filepath.Join(tmp, "scratch"), "t", disk(oldHost, 1000))
		write(t, filepath.Join(shared, "mine"), "s", disk(oldHost, 1000))
		if err := os.Symlink("/etc/passwd", filepath.Join(ws, "to-node")); err != nil {
			t.Fatal(err)
		}
		os.Lchown(filepath.Join(ws, "to-node"), disk(oldHost, 1000), disk(oldHost, 1000))
		if err := pack(old, images, time.Now().Add(time.Minute)); err != nil {
			t.Fatal(err)
		}
		skipped, err := volumesBack(filepath.Join(images, volumesFile), new)
		if err != nil || skipped != 0 {
			t.Fatalf("idmapped %v: %d skipped, %v", idmapped, skipped, err)
		}
		nws, ntmp, nshared := new.Mounts[0].Source, new.Mounts[1].Source, new.Mounts[2].Source
		for path, body := range map[string]string{
			filepath.Join(nws, "log.txt"): "ab", filepath.Join(nws, "d/e/f"): "deep",
			filepath.Join(ntmp, "scratch"): "t",
		} {
			if got, err := os.ReadFile(path); err != nil || string(got) != body {
				t.Fatalf("idmapped %v: %s: %q, %v", idmapped, path, got, err)
			}
			if uid := owner(t, path); uid != disk(newHost, 1000) {
				t.Fatalf("idmapped %v: %s owned by %d, not %d", idmapped, path, uid, disk(newHost, 1000))
			}
		}
		if uid := owner(t, filepath.Join(nws, "d")); uid != disk(newHost, 1000) {
			t.Fatalf("idmapped %v: d owned by %d", idmapped, uid)
		}
		if target, err := os.Readlink(filepath.Join(nws, "to-node")); err != nil || target != "/etc/passwd" {
			t.Fatalf("the link is not a link to /etc/passwd: %q, %v", target, err)
		}
		if _, err := os.Stat(filepath.Join(nshared, "mine")); !os.IsNotExist(err) {
			t.Fatalf("the claim's file was packed: %v", err)
		}
	}
}

func TestAPackedVolumeReachesNothingOutOfTheNewOnes(t *testing.T) {
	images, base, outside := t.TempDir(), t.TempDir(), t.TempDir()
	new := podWithVolumes(t, base, newHost, true)
	victim := filepath.Join(outside, "victim")
	write(t, victim, "node", 0)
	// A volume packed by a hostile node neighbour's tar, or a kernel's names: links out,
	// then names through them, `..`, a mount point the new pod has no emptyDir at.
	f, err := os.Create(filepath.Join(images, volumesFile))
	if err != nil {
		t.Fatal(err)
	}
	gz := gzip.NewWriter(f)
	tw := tar.NewWriter(gz)
	for _, e := range []entry{
		{name: "workspace/out", kind: tar.TypeSymlink, link: outside, uid: 1000},
		{name: "workspace/out/victim", kind: tar.TypeReg, mode: 0o644, uid: 1000, body: "kernel"},
		{name: "workspace/../../victim", kind: tar.TypeReg, mode: 0o644, uid: 1000, body: "kernel"},
		{name: "workspace/hard", kind: tar.TypeLink, link: victim, uid: 1000},
		{name: "shared/x", kind: tar.TypeReg, mode: 0o644, uid: 1000, body: "kernel"},
		{name: "workspace/suid", kind: tar.TypeReg, mode: 0o4755, uid: 0, body: "x"},
		{name: "workspace/foreign", kind: tar.TypeReg, mode: 0o644, uid: 70000, body: "x"},
		{name: "workspace/.wh.keep", kind: tar.TypeReg, mode: 0o644, uid: 1000, body: "w"},
	} {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.kind, Mode: e.mode,
			Uid: e.uid, Gid: e.uid, Size: int64(len(e.body)), ModTime: time.Unix(1700000000, 0)}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(e.body))
	}
	tw.Close()
	gz.Close()
	f.Close()
	skipped, err := volumesBack(filepath.Join(images, volumesFile), new)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(victim); string(got) != "node" || owner(t, victim) != 0 {
		t.Fatalf("the node's file was written: %q", got)
	}
	ws := new.Mounts[0].Source
	if info, err := os.Lstat(filepath.Join(ws, "suid")); err != nil || info.Mode()&os.ModeSetuid != 0 {
		t.Fatalf("suid: %v, %v", info, err)
	}
	if _, err := os.Lstat(filepath.Join(ws, "foreign")); !os.IsNotExist(err) {
		t.Fatalf("an owner the pod does not map was written: %v", err)
	}
	if got, err := os.ReadFile(filepath.Join(ws, ".wh.keep")); err != nil || string(got) != "w" {
		t.Fatalf("a volume's file named like a whiteout is a file: %q, %v", got, err)
	}
	if _, err := os.Stat(filepath.Join(new.Mounts[2].Source, "x")); !os.IsNotExist(err) {
		t.Fatalf("an entry of the claim's mount point was written: %v", err)
	}
	if skipped < 4 {
		t.Fatalf("%d skipped, want at least the entries through the link, .., the claim, the foreign owner", skipped)
	}
}

func TestOwnersThePodDoesNotMapAreNotPacked(t *testing.T) {
	images, base := t.TempDir(), t.TempDir()
	old := podWithVolumes(t, base, oldHost, true)
	ws := old.Mounts[0].Source
	write(t, filepath.Join(ws, "mine"), "m", 1000)
	write(t, filepath.Join(ws, "theirs/x"), "x", 70000) // not in the mount's idmapping
	os.Lchown(filepath.Join(ws, "theirs"), 70000, 70000)
	if err := pack(old, images, time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(images, volumesFile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var names []string
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		names = append(names, h.Name)
	}
	if len(names) != 1 || names[0] != "workspace/mine" {
		t.Fatalf("packed %v", names)
	}
}

func TestAContainerWithoutEmptyDirsPacksNothing(t *testing.T) {
	images := t.TempDir()
	if err := pack(podSpec(oldHost), images, time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(images, volumesFile)); !os.IsNotExist(err) {
		t.Fatalf("%v", err)
	}
	if skipped, err := volumesBack(filepath.Join(images, volumesFile), podSpec(newHost)); err != nil || skipped != 0 {
		t.Fatalf("%d, %v", skipped, err)
	}
}

func TestAFIFOInAVolumeIsLeftOutAndBlocksNothing(t *testing.T) {
	images, base := t.TempDir(), t.TempDir()
	old := podWithVolumes(t, base, oldHost, true)
	ws := old.Mounts[0].Source
	if err := syscall.Mkfifo(filepath.Join(ws, "pipe"), 0o644); err != nil {
		t.Fatal(err)
	}
	write(t, filepath.Join(ws, "after"), "a", 1000)
	done := make(chan error, 1)
	go func() { done <- pack(old, images, time.Now().Add(time.Minute)) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("packing a volume with a FIFO blocked")
	}
	new := podWithVolumes(t, t.TempDir(), newHost, true)
	if _, err := volumesBack(filepath.Join(images, volumesFile), new); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(filepath.Join(new.Mounts[0].Source, "pipe")); !os.IsNotExist(err) {
		t.Fatalf("the FIFO came back: %v", err)
	}
	if got, _ := os.ReadFile(filepath.Join(new.Mounts[0].Source, "after")); string(got) != "a" {
		t.Fatalf("after: %q", got)
	}
}

func TestVolumesNotPackedInTimeFailTheWakeAndSayWhy(t *testing.T) {
	images, base := t.TempDir(), t.TempDir()
	old := podWithVolumes(t, base, oldHost, true)
	write(t, filepath.Join(old.Mounts[0].Source, "f"), "x", 1000)
	err := pack(old, images, time.Now().Add(-time.Second))
	if err == nil || !strings.Contains(err.Error(), "took more than") {
		t.Fatalf("%v", err)
	}
	if entries, _ := os.ReadDir(images); len(entries) != 0 {
		t.Fatalf("left %v", entries)
	}
	// As packVolumes says it for the wake:
	os.WriteFile(filepath.Join(images, volumesFailed), []byte(err.Error()), 0o600)
	_, err = volumesBack(filepath.Join(images, volumesFile), podWithVolumes(t, t.TempDir(), newHost, true))
	if err == nil || !strings.Contains(err.Error(), "not packed: packing the volumes took more than") {
		t.Fatalf("%v", err)
	}
}

func TestAVolumeFileIsWrittenOnlyIfItFitsTheNewVolume(t *testing.T) {
	images, base := t.TempDir(), t.TempDir()
	old := podWithVolumes(t, base, oldHost, true)
	write(t, filepath.Join(old.Mounts[1].Source, "big"), strings.Repeat("b", 3<<20), 1000)
	if err := pack(old, images, time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	new := podWithVolumes(t, t.TempDir(), newHost, true)
	small := new.Mounts[1].Source // a memory /tmp smaller than the file
	if err := syscall.Mount("tmpfs", small, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("no tmpfs here: %v", err)
	}
	defer syscall.Unmount(small, syscall.MNT_DETACH)
	_, err := volumesBack(filepath.Join(images, volumesFile), new)
	if err == nil || !strings.Contains(err.Error(), "do not fit") {
		t.Fatalf("%v", err)
	}
}

func TestTheDeadlineHoldsWithinASparseFileOfGigabytes(t *testing.T) {
	images, base := t.TempDir(), t.TempDir()
	old := podWithVolumes(t, base, oldHost, true)
	big := filepath.Join(old.Mounts[0].Source, "sparse")
	write(t, big, "", 1000)
	if err := os.Truncate(big, 8<<30); err != nil { // costs the disk nothing
		t.Fatal(err)
	}
	started := time.Now()
	err := pack(old, images, started.Add(200*time.Millisecond))
	if err == nil || !strings.Contains(err.Error(), "took more than") {
		t.Fatalf("%v", err)
	}
	if took := time.Since(started); took > 5*time.Second {
		t.Fatalf("the pack went on %s past its deadline", took)
	}
}
