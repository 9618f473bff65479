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
	base := t.TempDir()
	t.Setenv("MCPFORGE_RESTORE_DIR", base)
	room := filepath.Join(base, spentPrefix+"0-room")
	os.Mkdir(room, 0o700)
	os.WriteFile(filepath.Join(room, "pages-1.img"), []byte("x"), 0o600)
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
