package main

import (
	"archive/tar"
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// taken.go: a checkpoint's images kept unpacked, linked into a wake's directory, and swept
// once no archive of the node names them.

func keptSetup(t *testing.T) (images, base, checkpoints string) {
	t.Helper()
	dir := t.TempDir()
	images, base, checkpoints = filepath.Join(dir, "images"), filepath.Join(dir, "restore"), filepath.Join(dir, "checkpoints")
	for _, d := range []string{images, base, checkpoints} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("MCPFORGE_RESTORE_DIR", base)
	t.Setenv("MCPFORGE_CHECKPOINTS", checkpoints)
	os.WriteFile(filepath.Join(images, "inventory.img"), []byte("inventory"), 0o600)
	os.WriteFile(filepath.Join(images, "pages-1.img"), bytes.Repeat([]byte{1}, 1<<20), 0o600)
	return images, base, checkpoints
}

func tokenIn(t *testing.T, images string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(images, takenFile))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func TestKeptImagesAreLinkedIntoAWakeOnlyIfEachIsAsTheArchiveHasIt(t *testing.T) {
	images, base, _ := keptSetup(t)
	if err := keep(images); err != nil {
		t.Fatal(err)
	}
	token := tokenIn(t, images)
	if !tokenPattern.MatchString(token) {
		t.Fatalf("token %q", token)
	}
	// As scan finds them in the archive: the token is among them.
	want := map[string]int64{"inventory.img": 9, "pages-1.img": 1 << 20, takenFile: 33}
	room := t.TempDir()
	wrong := map[string]int64{"inventory.img": 9, "pages-1.img": 5}
	if fromTaken(token, wrong, room) {
		t.Fatal("taken at another size")
	}
	if entries, _ := os.ReadDir(room); len(entries) != 0 {
		t.Fatalf("left %v", entries)
	}
	for _, bad := range []string{"", "../restore", strings.Repeat("g", 32)} {
		if fromTaken(bad, want, room) {
			t.Fatalf("token %q taken", bad)
		}
	}
	if !fromTaken(token, want, room) {
		t.Fatal("not taken")
	}
	if got, _ := os.ReadFile(filepath.Join(room, "inventory.img")); string(got) != "inventory" {
		t.Fatalf("inventory %q", got)
	}
	if takenPath(token) != filepath.Join(base, takenDir, token) || takenPath("../x") != "" {
		t.Fatal("kept where?")
	}
}

func TestKeptImagesNoArchiveNamesAreSweptOnceOld(t *testing.T) {
	images, base, checkpoints := keptSetup(t)
	if err := keep(images); err != nil {
		t.Fatal(err)
	}
	held := tokenIn(t, images)
	if err := keep(images); err != nil {
		t.Fatal(err)
	}
	orphan := tokenIn(t, images)
	// The kubelet's archive of the first checkpoint names its token.
	var b bytes.Buffer
	w := tar.NewWriter(&b)
	w.WriteHeader(&tar.Header{Name: "checkpoint/" + takenFile, Mode: 0o600, Size: int64(len(held) + 1), Typeflag: tar.TypeReg})
	w.Write([]byte(held + "\n"))
	w.Close()
	os.WriteFile(filepath.Join(checkpoints, "checkpoint-ks-a_team-kernel-2026-12-06T10:00:00Z.tar"), b.Bytes(), 0o600)
	sweepTaken(base) // both are new: kept
	for _, token := range []string{held, orphan} {
		if _, err := os.Lstat(filepath.Join(base, takenDir, token)); err != nil {
			t.Fatalf("%s swept while new", token)
		}
		old := time.Now().Add(-2 * takenGrace)
		os.Chtimes(filepath.Join(base, takenDir, token), old, old)
	}
	sweepTaken(base)
	if _, err := os.Lstat(filepath.Join(base, takenDir, held)); err != nil {
		t.Fatal("the held one was swept")
	}
	if _, err := os.Lstat(filepath.Join(base, takenDir, orphan)); err == nil {
		t.Fatal("the orphan was kept")
	}
}

func TestACheckpointSweepsWhatAKilledHandlerLeft(t *testing.T) {
	images, base, _ := keptSetup(t)
	spent = nil
	if err := keep(images); err != nil {
		t.Fatal(err)
	}
	orphan := filepath.Join(base, takenDir, tokenIn(t, images)) // no archive names it
	left := filepath.Join(base, spentPrefix+"0badf00d-abc123")  // a remover was killed
	os.Mkdir(left, 0o700)
	old := time.Now().Add(-2 * takenGrace)
	for _, p := range []string{orphan, left} {
		os.Chtimes(p, old, old)
	}
	if err := keep(images); err != nil { // the next checkpoint on the node
		t.Fatal(err)
	}
	if _, err := os.Lstat(orphan); err == nil {
		t.Fatal("the orphan's kept images are still there")
	}
	if len(spent) != 2 || spent[0] != left || !strings.HasPrefix(filepath.Base(spent[1]), spentPrefix) {
		t.Fatalf("spent: %v", spent)
	}
	removeNow(spent, true)
	for _, p := range spent {
		if _, err := os.Lstat(p); err == nil {
			t.Fatalf("%s not removed", p)
		}
	}
	spent = nil
}

func TestASpentRestoreDirectoryIsSetAsideAtOnceAndRemovedLater(t *testing.T) {
	base := t.TempDir()
	t.Setenv("MCPFORGE_RESTORE_DIR", base)
	dir := filepath.Join(base, "abc123")
	os.Mkdir(dir, 0o700)
	os.WriteFile(filepath.Join(dir, "pages-1.img"), []byte("x"), 0o600)
	spent = nil
	setAside(dir)
	if _, err := os.Lstat(dir); err == nil || len(spent) != 1 {
		t.Fatalf("not set aside: %v", spent)
	}
	aside := spent[0]
	if filepath.Dir(aside) != base || !strings.HasPrefix(filepath.Base(aside), spentPrefix) ||
		!strings.HasSuffix(aside, "-abc123") {
		t.Fatalf("set aside as %s", aside)
	}
	// A directory a pod made where a claim's copy was is not removed with what it holds.
	claim := t.TempDir()
	theirs := filepath.Join(claim, spentPrefix+"00-snapshot.tar")
	os.Mkdir(theirs, 0o700)
	os.WriteFile(filepath.Join(theirs, "file"), []byte("x"), 0o600)
	removeNow([]string{theirs}, true)
	if _, err := os.Lstat(filepath.Join(theirs, "file")); err != nil {
		t.Fatal("a pod's directory was removed")
	}
	victim := filepath.Join(t.TempDir(), "victim")
	os.WriteFile(victim, []byte("kept"), 0o600)
	link := filepath.Join(base, spentPrefix+"link")
	os.Symlink(victim, link)
	removeNow([]string{aside, link, "relative", "/"}, true)
	if _, err := os.Lstat(aside); err == nil {
		t.Fatal("not removed")
	}
	if got, _ := os.ReadFile(victim); string(got) != "kept" {
		t.Fatal("removed through a link")
	}
	spent = nil
}

func TestACheckpointNeverWaitsForTheNodesRestoresItKeepsNothingThen(t *testing.T) {
	images, base, _ := keptSetup(t)
	unlock, err := lockRestores(base, true)
	if err != nil || unlock == nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- keep(images) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the checkpoint waited for the lock")
	}
	unlock()
	if _, err := os.Lstat(filepath.Join(images, takenFile)); err == nil {
		t.Fatal("a token without kept images")
	}
	if info, err := os.Stat(base); err != nil || info.Mode().Perm() != 0o700 && info.Mode().Perm() != 0o711 {
		t.Fatalf("base %v %v", info, err)
	}
}

func TestAWakesRoomIsTakenUnderTheLockWhichItsRestoreNeedNotHold(t *testing.T) {
	base := t.TempDir()
	t.Setenv("MCPFORGE_RESTORE_DIR", base)
	t.Setenv("MCPFORGE_CHECKPOINTS", t.TempDir())
	spent = nil
	first, unlock, done, err := room("first")
	if err != nil {
		t.Fatal(err)
	}
	if free, _ := lockRestores(base, false); free != nil {
		free()
		t.Fatal("the lock is free while the first wake puts its images in place")
	}
	unlock() // its images are in place: its restore runs unlocked
	unlock() // and again, as its done does: a no-op
	second := make(chan error, 1)
	go func() {
		_, _, done2, err := room("second")
		if err == nil {
			done2()
		}
		second <- err
	}()
	select {
	case err := <-second:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the next wake waited for the first's restore")
	}
	done()
	if _, err := os.Lstat(first); err == nil {
		t.Fatal("the first room is still there once done")
	}
	removeNow(spent, true)
	if entries, _ := os.ReadDir(base); len(entries) != 1 || entries[0].Name() != ".lock" {
		t.Fatalf("left: %v", entries)
	}
	spent = nil
	// A container whose restore runs (its mounts held) is not given a room again: its
	// images are not removed under it.
	running, unlockRunning, doneRunning, err := room("running")
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(running, "pages-1.img"), []byte("x"), 0o600)
	held, err := holdMounts(filepath.Join(base, idmappedDir, "running"))
	if err != nil {
		t.Fatal(err)
	}
	unlockRunning() // its restore runs
	if _, _, _, err := room("running"); err == nil || !strings.Contains(err.Error(), "is running") {
		t.Fatalf("a second room for a running restore: %v", err)
	}
	if _, err := os.Stat(filepath.Join(running, "pages-1.img")); err != nil {
		t.Fatal("the running restore's images were removed")
	}
	held.Close()
	doneRunning()
	spent = nil
}

func TestStaleIdmappedMountsAreClearedButNotThoseARunningRestoreHolds(t *testing.T) {
	root := t.TempDir()
	live, stale := filepath.Join(root, "live"), filepath.Join(root, "stale")
	held, err := holdMounts(live)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	for _, dir := range []string{live, stale} {
		os.Mkdir(dir, 0o700)
		os.WriteFile(filepath.Join(dir, "0"), nil, 0o600) // a mount point of a file
	}
	os.WriteFile(stale+".lock", nil, 0o600) // its handler was killed: nobody holds it
	if _, err := holdMounts(live); err == nil {
		t.Fatal("a second restore took the live one's mounts")
	}
	unmountStale(root)
	if _, err := os.Lstat(filepath.Join(live, "0")); err != nil {
		t.Fatal("a running restore's mounts were cleared")
	}
	for _, p := range []string{stale, stale + ".lock"} {
		if _, err := os.Lstat(p); err == nil {
			t.Fatalf("%s is left", p)
		}
	}
}

// A checkpoint waits for a page server of the container's wake to end (its shared lock
// on the restore's work directory), and gives up, saying why, past its bound.
func TestACheckpointWaitsForTheWokenKernelsPagesToBeIn(t *testing.T) {
	bundle := t.TempDir()
	if err := pagesIn(bundle, time.Second); err != nil {
		t.Fatalf("a kernel not woken lazily: %v", err)
	}
	work := filepath.Join(bundle, workDir)
	os.Mkdir(work, 0o700)
	held, err := hold(work)
	if err != nil {
		t.Fatal(err)
	}
	if err := pagesIn(bundle, 100*time.Millisecond); err == nil || !strings.Contains(err.Error(), "still being read in") {
		t.Fatalf("a checkpoint while pages are read in: %v", err)
	}
	go func() { time.Sleep(100 * time.Millisecond); closeAll(held) }() // the server ends
	if err := pagesIn(bundle, 10*time.Second); err != nil {
		t.Fatalf("once every page is in: %v", err)
	}
}
