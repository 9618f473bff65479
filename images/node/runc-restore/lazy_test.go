package main

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// The page server's process, run as this test binary (serveLazily runs the handler's).
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == lazyFlag {
		lazyServe(os.Args[2:])
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// serve runs the page server's process with `criu` standing for CRIU, a woken kernel
// (a sleep) named by the pid file; it returns the kernel and the process's end.
func serve(t *testing.T, criu string) (*exec.Cmd, error) {
	t.Helper()
	if !exists("/dev/userfaultfd") {
		t.Skip("no /dev/userfaultfd here")
	}
	dir := t.TempDir()
	victim := exec.Command("sleep", "60")
	if err := victim.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { victim.Process.Kill(); victim.Wait() })
	pidFile := filepath.Join(dir, "init.pid")
	if err := os.WriteFile(pidFile, []byte(strconv.Itoa(victim.Process.Pid)), 0o600); err != nil {
		t.Fatal(err)
	}
	status, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer status.Close()
	self, _ := os.Executable()
	cmd := exec.Command(self, lazyFlag, dir, dir, pidFile)
	cmd.Env = append(os.Environ(), "MCPFORGE_CRIU="+criu)
	life, handler, err := os.Pipe() // the handler's life: open throughout, as a wake's
	if err != nil {
		t.Fatal(err)
	}
	defer handler.Close()
	cmd.ExtraFiles = []*os.File{w, life}
	err = cmd.Run()
	w.Close()
	life.Close()
	return victim, err
}

func alive(cmd *exec.Cmd) bool {
	done := make(chan struct{})
	go func() { cmd.Process.Wait(); close(done) }()
	select {
	case <-done:
		return false
	case <-time.After(200 * time.Millisecond):
		return true
	}
}

func TestAPageServerThatFailsTakesTheWokenKernelWithIt(t *testing.T) {
	victim, err := serve(t, "false") // CRIU's page server ending in an error
	if err == nil {
		t.Fatal("the page server's process said nothing of its failure")
	}
	if alive(victim) {
		t.Fatal("a kernel whose pages were not all served runs on (its memory would read zeros)")
	}
}

func TestAPageServerThatEndsWellLeavesTheKernel(t *testing.T) {
	victim, err := serve(t, "true")
	if err != nil {
		t.Fatalf("the page server's process failed: %v", err)
	}
	if !alive(victim) {
		t.Fatal("a kernel whose pages were all served was killed")
	}
}

// CRIU, restoring from inside the container's cgroups, gets /dev/userfaultfd from the page
// server's process, once, on a socket of the work directory only root may enter.
func TestTheDeviceIsGivenOnceOnTheWorkDirectorysSocket(t *testing.T) {
	if !exists("/dev/userfaultfd") {
		t.Skip("no /dev/userfaultfd here")
	}
	here, _ := os.Getwd()
	defer os.Chdir(here)
	work := t.TempDir()
	if _, err := giveDevice(work); err != nil {
		t.Fatal(err)
	}
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: filepath.Join(work, uffdDevSocket), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	oob := make([]byte, syscall.CmsgSpace(4))
	_, n, _, _, err := conn.ReadMsgUnix(make([]byte, 1), oob)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := syscall.ParseSocketControlMessage(oob[:n])
	if err != nil || len(msgs) != 1 {
		t.Fatalf("no descriptor given: %v", err)
	}
	fds, err := syscall.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		t.Fatalf("no descriptor given: %v", err)
	}
	defer syscall.Close(fds[0])
	var st, dev syscall.Stat_t
	if syscall.Fstat(fds[0], &st) != nil || syscall.Stat("/dev/userfaultfd", &dev) != nil || st.Rdev != dev.Rdev {
		t.Fatal("what was given is not /dev/userfaultfd")
	}
	deadline := time.Now().Add(5 * time.Second)
	for exists(filepath.Join(work, uffdDevSocket)) {
		if time.Now().After(deadline) {
			t.Fatal("the socket stays after the device was given")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
