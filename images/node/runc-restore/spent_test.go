package main

import (
	"os"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"
)

// The remover starts after the wake's first seconds, at the lowest CPU priority, and then
// removes what was set aside.
func TestTheRemoverWaitsThenRemovesAtTheLowestPriority(t *testing.T) {
	room := spentRoom(t)
	defer func(was time.Duration) { removeAfter = was }(removeAfter)
	removeAfter = 200 * time.Millisecond

	done := make(chan int)
	started := time.Now()
	go func() {
		runtime.LockOSThread() // the nice is this thread's; it ends with the goroutine
		removeLater([]string{room})
		prio, _ := syscall.Getpriority(syscall.PRIO_PROCESS, 0)
		done <- prio
	}()
	prio := <-done
	if took := time.Since(started); took < removeAfter {
		t.Fatalf("removed after %v, before %v", took, removeAfter)
	}
	if _, err := os.Lstat(room); !os.IsNotExist(err) {
		t.Fatalf("not removed: %v", err)
	}
	if prio != 20-19 { // the raw syscall's value: 20 - nice
		t.Fatalf("the remover's priority read %d, not nice 19", prio)
	}
}

// A spent directory that a page server still reads from (its shared lock) is removed
// once the server has let go, not before.
func TestASpentDirectoryIsRemovedOnlyOnceNoPageServerHoldsIt(t *testing.T) {
	room := spentRoom(t)
	held, err := hold(room)
	if err != nil {
		t.Fatal(err)
	}
	removed := make(chan struct{})
	go func() {
		removeNow([]string{room}, true)
		close(removed)
	}()
	select {
	case <-removed:
		t.Fatal("removed while a page server held it")
	case <-time.After(300 * time.Millisecond): // it may not end: nothing to wait on but time
	}
	if _, err := os.Lstat(filepath.Join(room, "pages-1.img")); err != nil {
		t.Fatalf("its images went while held: %v", err)
	}
	closeAll(held)
	select {
	case <-removed:
	case <-time.After(10 * time.Second):
		t.Fatal("not removed once let go")
	}
	if _, err := os.Lstat(room); !os.IsNotExist(err) {
		t.Fatalf("not removed: %v", err)
	}
}

// spentRoom is a restore's room set aside, holding an image, in a restore directory of
// the test's own.
func spentRoom(t *testing.T) string {
	t.Helper()
	base := t.TempDir()
	t.Setenv("MCPFORGE_RESTORE_DIR", base)
	room := filepath.Join(base, spentPrefix+"0-room")
	os.Mkdir(room, 0o700)
	os.WriteFile(filepath.Join(room, "pages-1.img"), []byte("x"), 0o600)
	return room
}

// The sweep of what removers left passes over a directory a page server still holds (a
// remover would wait on it, one more at each wake), and takes it once let go.
func TestTheSweepLeavesWhatAPageServerHolds(t *testing.T) {
	room := spentRoom(t)
	t.Setenv("MCPFORGE_CHECKPOINTS", t.TempDir())
	old := time.Now().Add(-2 * time.Minute)
	if err := os.Chtimes(room, old, old); err != nil {
		t.Fatal(err)
	}
	defer func(was []string) { spent = was }(spent)
	held, err := hold(room)
	if err != nil {
		t.Fatal(err)
	}
	spent = nil
	sweepSpent(filepath.Dir(room))
	if len(spent) != 0 {
		t.Fatalf("a held directory was swept: %v", spent)
	}
	closeAll(held)
	sweepSpent(filepath.Dir(room))
	if len(spent) != 1 || spent[0] != room {
		t.Fatalf("once let go, the sweep took %v, not %s", spent, room)
	}
}
