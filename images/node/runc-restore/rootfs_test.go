package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

const oldHost, newHost = 200000, 300000 // the old and the new pod's first host ids

func podSpec(host int) *spec {
	s := &spec{}
	s.Linux.UIDMappings = []idMap{{ContainerID: 0, HostID: host, Size: 65536}}
	s.Linux.GIDMappings = []idMap{{ContainerID: 0, HostID: host, Size: 65536}}
	return s
}

type entry struct {
	name, link string
	kind       byte
	mode       int64
	uid        int
	body       string
}

// diffOf is a rootfs-diff.tar as containerd writes it: gzip, owners the old pod's host ids.
func diffOf(t *testing.T, dir string, entries []entry) string {
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.kind, Mode: e.mode,
			Uid: e.uid, Gid: e.uid, Size: int64(len(e.body)), ModTime: time.Unix(1700000000, 0)}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(e.body)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := gz.Close(); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, rootfsDiffFile)
	if err := os.WriteFile(path, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func owner(t *testing.T, path string) int {
	var st syscall.Stat_t
	if err := syscall.Lstat(path, &st); err != nil {
		t.Fatal(err)
	}
	return int(st.Uid)
}

func TestTheWorkspaceComesBackWithItsOwnersMovedToTheNewPod(t *testing.T) {
	dir, rootfs := t.TempDir(), t.TempDir()
	if err := os.MkdirAll(filepath.Join(rootfs, "usr/lib"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rootfs, "usr/lib/gone"), []byte("image"), 0o644); err != nil {
		t.Fatal(err)
	}
	diff := diffOf(t, dir, []entry{
		{name: "workspace/", kind: tar.TypeDir, mode: 0o755, uid: oldHost + 1000},
		{name: "workspace/data.csv", kind: tar.TypeReg, mode: 0o644, uid: oldHost + 1000, body: "a,b\n1,2\n"},
		{name: "workspace/same.csv", kind: tar.TypeLink, link: "workspace/data.csv", uid: oldHost + 1000},
		{name: "workspace/here", kind: tar.TypeSymlink, link: "data.csv", uid: oldHost + 1000},
		{name: "tmp/run.sh", kind: tar.TypeReg, mode: 0o4755, uid: oldHost, body: "#!/bin/sh\n"},
		{name: "usr/lib/.wh.gone", kind: tar.TypeReg, uid: oldHost},
	})
	skipped, err := putBack(diff, rootfs, podSpec(oldHost), podSpec(newHost))
	if err != nil || skipped != 0 {
		t.Fatalf("putBack: %d skipped, %v", skipped, err)
	}
	data, err := os.ReadFile(filepath.Join(rootfs, "workspace/data.csv"))
	if err != nil || string(data) != "a,b\n1,2\n" {
		t.Fatalf("data.csv: %q %v", data, err)
	}
	for _, name := range []string{"workspace", "workspace/data.csv", "workspace/here"} {
		if got := owner(t, filepath.Join(rootfs, name)); got != newHost+1000 {
			t.Errorf("%s is owned by %d, not the new pod's %d", name, got, newHost+1000)
		}
	}
	if link, _ := os.Readlink(filepath.Join(rootfs, "workspace/here")); link != "data.csv" {
		t.Errorf("the link points at %q", link)
	}
	a, _ := os.Stat(filepath.Join(rootfs, "workspace/data.csv"))
	b, _ := os.Stat(filepath.Join(rootfs, "workspace/same.csv"))
	if a == nil || b == nil || !os.SameFile(a, b) {
		t.Error("the hard link is not one file with its target")
	}
	if info, _ := os.Stat(filepath.Join(rootfs, "tmp/run.sh")); info == nil || info.Mode()&os.ModeSetuid != 0 || info.Mode().Perm() != 0o755 {
		t.Errorf("run.sh: %v (set-id bits must go, the rest stay)", info)
	}
	if got := owner(t, filepath.Join(rootfs, "tmp/run.sh")); got != newHost {
		t.Errorf("run.sh is owned by %d", got)
	}
	if _, err := os.Lstat(filepath.Join(rootfs, "usr/lib/gone")); !os.IsNotExist(err) {
		t.Errorf("the whiteout did not remove what the kernel deleted: %v", err)
	}
	if !a.ModTime().Equal(time.Unix(1700000000, 0)) {
		t.Errorf("data.csv's time is %v", a.ModTime())
	}
}

func TestNothingOfTheDiffReachesOutOfTheRootfs(t *testing.T) {
	outside := t.TempDir()
	secret := filepath.Join(outside, "secret")
	if err := os.WriteFile(secret, []byte("host"), 0o600); err != nil {
		t.Fatal(err)
	}
	links := []entry{
		{name: "workspace/", kind: tar.TypeDir, mode: 0o755, uid: oldHost},
		{name: "workspace/out", kind: tar.TypeSymlink, link: outside, uid: oldHost},
		{name: "workspace/up", kind: tar.TypeSymlink, link: "../../../../../../" + outside, uid: oldHost},
	}
	// Each after links the kernel planted in its workspace (its own diff's entries).
	for _, bad := range []entry{
		{name: "workspace/out/secret", kind: tar.TypeReg, mode: 0o644, uid: oldHost, body: "kernel"},
		{name: "workspace/up/planted", kind: tar.TypeReg, mode: 0o644, uid: oldHost, body: "kernel"},
		{name: "workspace/out/", kind: tar.TypeDir, mode: 0o777, uid: oldHost},
		{name: "workspace/out/.wh.secret", kind: tar.TypeReg, uid: oldHost},
		{name: "workspace/out/made/", kind: tar.TypeDir, mode: 0o755, uid: oldHost},
		{name: "workspace/hard", kind: tar.TypeLink, link: secret, uid: oldHost},
		{name: "workspace/hard", kind: tar.TypeLink, link: "workspace/out/secret", uid: oldHost},
		{name: "../../../../escaped", kind: tar.TypeReg, mode: 0o644, uid: oldHost, body: "kernel"},
	} {
		rootfs := t.TempDir()
		diff := diffOf(t, t.TempDir(), append(append([]entry{}, links...), bad))
		_, err := putBack(diff, rootfs, podSpec(oldHost), podSpec(newHost))
		if info, _ := os.Stat(secret); info == nil || info.Mode().Perm() != 0o600 {
			t.Fatalf("%s: the host's file was changed through a link: %v", bad.name, info)
		}
		if data, _ := os.ReadFile(secret); string(data) != "host" {
			t.Fatalf("%s: the host's file was written through a link: %q", bad.name, data)
		}
		if entries, _ := os.ReadDir(outside); len(entries) != 1 {
			t.Fatalf("%s: something was made outside the rootfs: %v", bad.name, entries)
		}
		if _, err := os.Lstat(filepath.Join(filepath.Dir(rootfs), "escaped")); err == nil {
			t.Fatalf("%s: a ../ name was written beside the rootfs", bad.name)
		}
		if bad.name == "../../../../escaped" {
			if err != nil {
				t.Fatalf("a ../ name is put back inside the rootfs: %v", err)
			}
			if _, err := os.Lstat(filepath.Join(rootfs, "escaped")); err != nil {
				t.Fatalf("a ../ name was not put back inside the rootfs: %v", err)
			}
		} else if err != nil {
			t.Errorf("%s: an entry that cannot be put back failed the wake: %v", bad.name, err)
		}
		// The links themselves are the kernel's own, made as links inside its rootfs (a
		// directory of the same name, later in the diff, replaces one).
		if link, _ := os.Readlink(filepath.Join(rootfs, "workspace/out")); link != outside && bad.name != "workspace/out/" {
			t.Errorf("%s: the link was not made as it was: %q", bad.name, link)
		}
	}
}

func TestEntriesOfOwnersOutsideThePodAndDevicesAreSkipped(t *testing.T) {
	dir, rootfs := t.TempDir(), t.TempDir()
	diff := diffOf(t, dir, []entry{
		{name: "workspace/", kind: tar.TypeDir, mode: 0o755, uid: oldHost},
		{name: "workspace/host-root", kind: tar.TypeReg, mode: 0o644, uid: 0, body: "x"},
		{name: "workspace/fifo", kind: tar.TypeFifo, mode: 0o644, uid: oldHost},
		{name: "workspace/null", kind: tar.TypeChar, mode: 0o666, uid: oldHost},
		{name: "workspace/kept", kind: tar.TypeReg, mode: 0o644, uid: oldHost + 5, body: "y"},
	})
	skipped, err := putBack(diff, rootfs, podSpec(oldHost), podSpec(newHost))
	if err != nil || skipped != 3 {
		t.Fatalf("putBack: %d skipped (want 3), %v", skipped, err)
	}
	for _, name := range []string{"host-root", "fifo", "null"} {
		if _, err := os.Lstat(filepath.Join(rootfs, "workspace", name)); err == nil {
			t.Errorf("%s was put back", name)
		}
	}
	if got := owner(t, filepath.Join(rootfs, "workspace/kept")); got != newHost+5 {
		t.Errorf("kept is owned by %d", got)
	}
}

func TestAnArchiveWithoutADiffPutsNothingBack(t *testing.T) {
	rootfs := t.TempDir()
	skipped, err := putBack(filepath.Join(t.TempDir(), rootfsDiffFile), rootfs, podSpec(oldHost), podSpec(newHost))
	if err != nil || skipped != 0 {
		t.Fatalf("%d, %v", skipped, err)
	}
}

func TestModesHolesAndOddNamesComeBackAsTheyShould(t *testing.T) {
	dir, rootfs := t.TempDir(), t.TempDir()
	zeros := string(make([]byte, 4<<20))
	new := podSpec(newHost)
	new.Mounts = append(new.Mounts, mount{Destination: "/etc/hosts"})
	diff := diffOf(t, dir, []entry{
		{name: "tmp/", kind: tar.TypeDir, mode: 0o1777, uid: oldHost},
		{name: "tmp/sparse", kind: tar.TypeReg, mode: 0o644, uid: oldHost, body: zeros + "end"},
		{name: "workspace/", kind: tar.TypeDir, mode: 0o755, uid: oldHost},
		{name: "workspace/.wh..", kind: tar.TypeReg, uid: oldHost},
		{name: ".wh..", kind: tar.TypeReg, uid: oldHost},
		{name: "theirs/", kind: tar.TypeDir, mode: 0o755, uid: 0},
		{name: "theirs/inside", kind: tar.TypeReg, mode: 0o644, uid: oldHost, body: "x"},
		{name: "etc", kind: tar.TypeSymlink, link: "/", uid: oldHost},
		{name: "etc/hosts", kind: tar.TypeReg, mode: 0o644, uid: oldHost, body: "mine"},
		{name: "proc/self", kind: tar.TypeReg, mode: 0o644, uid: oldHost, body: "x"},
		{name: "workspace/fifo", kind: tar.TypeFifo, mode: 0o644, uid: oldHost},
		{name: "workspace/to-fifo", kind: tar.TypeLink, link: "workspace/fifo", uid: oldHost},
		{name: "workspace/last", kind: tar.TypeReg, mode: 0o644, uid: oldHost, body: "last"},
	})
	skipped, err := putBack(diff, rootfs, podSpec(oldHost), new)
	if err != nil {
		t.Fatalf("putBack: %v", err)
	}
	if skipped != 9 {
		t.Errorf("%d skipped, want 9", skipped)
	}
	if info, err := os.Stat(filepath.Join(rootfs, "tmp")); err != nil || info.Mode()&os.ModeSticky == 0 || info.Mode().Perm() != 0o777 {
		t.Errorf("/tmp lost its sticky bit: %v %v", info, err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(rootfs, "tmp/sparse"), &st); err != nil || st.Size != 4<<20+3 || st.Blocks*512 > 1<<20 {
		t.Errorf("the sparse file is %d bytes in %d blocks (%v): its zeros were written", st.Size, st.Blocks, err)
	}
	if data, _ := os.ReadFile(filepath.Join(rootfs, "tmp/sparse")); string(data[len(data)-3:]) != "end" {
		t.Error("the sparse file's data is not at its end")
	}
	for _, gone := range []string{"theirs", "etc", "proc"} {
		if _, err := os.Lstat(filepath.Join(rootfs, gone)); err == nil {
			t.Errorf("%s was put back", gone)
		}
	}
	if data, err := os.ReadFile(filepath.Join(rootfs, "workspace/last")); err != nil || string(data) != "last" {
		t.Errorf("an entry after those skipped was not put back: %q %v", data, err)
	}
}
