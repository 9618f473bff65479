package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// Lazy pages (docs/design.md §14): a woken kernel runs before its memory is read. runc
// restores it with `--lazy-pages`; CRIU then maps the kernel's memory empty, registered
// with a userfaultfd, which it hands to a page server on the node (`criu lazy-pages`,
// reading the same images), and the kernel runs at once: a page it touches is served on
// its fault, and the server writes the others in, in the background, until every page is
// in; then it ends. The restored task lives in the pod's user namespace, where
// userfaultfd() is refused (it asks CAP_SYS_PTRACE of the host's namespace unless
// vm.unprivileged_userfaultfd is 1, for every process of the host): our CRIU opens
// /dev/userfaultfd (root's) before it makes any task and has the task ask the device for
// its descriptor (images/criu/lazy-from-dev.patch), which the page server's process
// gives it (giveDevice).
//
// The page server must outlive this program (containerd waits for it; the pages come
// after), so it runs under a process of this program's own (lazyFlag), detached, which
// waits for it: a server that ends before every page is in (killed, an error) would
// leave the kernel's untouched memory reading as zeros, so that process kills the woken
// kernel then, and the pod fails as a failed wake does (a new kernel, which says its
// variables were lost). MCPFORGE_LAZY_PAGES=0 turns lazy pages off; so does a node
// without /dev/userfaultfd.

const (
	lazyFlag      = "--mcpforge-lazy-pages"
	lazyLog       = "lazy-pages.log"    // CRIU's, in the restore's work directory
	serveLog      = "mcpforge-lazy.log" // the process that waits for CRIU's, beside it
	uffdDevSocket = "uffd-dev.socket"   // where CRIU asks for /dev/userfaultfd (giveDevice)
	lazyDeadline  = 10 * time.Second    // for the server to listen
)

// lazyPages says whether this node's wakes read their pages lazily.
func lazyPages() bool {
	return env("MCPFORGE_LAZY_PAGES", "1") != "0" && exists("/dev/userfaultfd")
}

// serveLazily starts the page server for a restore from images (its socket in work), and
// returns once it listens, with a stop that ends it (for a restore that failed).
func serveLazily(images, work, pidFile string) (stop func(), err error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	ready, signal, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer ready.Close()
	cmd := exec.Command(self, lazyFlag, images, work, pidFile)
	cmd.ExtraFiles = []*os.File{signal} // its descriptor 3: CRIU's --status-fd
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.Dir = "/"
	if said, e := os.OpenFile(filepath.Join(work, serveLog), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600); e == nil {
		defer said.Close()
		cmd.Stderr = said
	}
	err = cmd.Start()
	signal.Close()
	if err != nil {
		return nil, fmt.Errorf("the page server: %w", err)
	}
	stop = func() { syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) } // its group: CRIU too
	go cmd.Wait()                                                     // reaped here if it ends before this program does
	ready.SetReadDeadline(time.Now().Add(lazyDeadline))
	b := make([]byte, 1)
	if n, _ := ready.Read(b); n != 1 {
		stop()
		return nil, fmt.Errorf("the page server did not listen within %s; CRIU said: %s",
			lazyDeadline, tail(filepath.Join(work, lazyLog), 600))
	}
	return stop, nil
}

// lazyServe is the process serveLazily starts: `criu lazy-pages` as its child, told to
// write to descriptor 3 once it listens; if CRIU ends with an error, the woken kernel (the
// process runc's pid file names, once it is written) is killed.
func lazyServe(args []string) {
	if len(args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: mcpforge-runc "+lazyFlag+" IMAGES WORK PIDFILE")
		os.Exit(2)
	}
	images, work, pidFile := args[0], args[1], args[2]
	status := os.NewFile(3, "status")
	if err := giveDevice(work); err != nil {
		fmt.Fprintf(os.Stderr, "mcpforge-runc: %v\n", err)
		os.Exit(1)
	}
	criu := exec.Command(env("MCPFORGE_CRIU", "criu"), "lazy-pages", "--images-dir", images,
		"--work-dir", work, "--status-fd", "3", "-o", lazyLog, "-v2")
	criu.ExtraFiles = []*os.File{status}
	criu.Dir = "/"
	err := criu.Start()
	status.Close()
	if err == nil {
		err = criu.Wait()
	}
	if err == nil {
		return
	}
	// runc writes the pid file once the restore is done; a restore that fails ends this
	// process (serveLazily's stop) before the deadline.
	for end := time.Now().Add(3 * lazyDeadline); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if pid := pidIn(pidFile); pid > 0 {
			syscall.Kill(pid, syscall.SIGKILL)
			fmt.Fprintf(os.Stderr, "mcpforge-runc: the page server of %s ended (%v): the woken kernel (pid %d) was killed\n", images, err, pid)
			break
		}
	}
	os.Exit(1)
}

// giveDevice serves /dev/userfaultfd, open, once, on uffdDevSocket in work: runc restores
// from inside the container's cgroups, whose device rules refuse CRIU the device
// (images/criu/lazy-from-dev.patch). The work directory is root's alone (0700).
func giveDevice(work string) error {
	dev, err := os.OpenFile("/dev/userfaultfd", os.O_RDWR, 0)
	if err != nil {
		return err
	}
	// A name relative to the work directory, as CRIU's: a bundle's path is longer than a
	// socket's address may be.
	if err := os.Chdir(work); err != nil {
		dev.Close()
		return err
	}
	os.Remove(uffdDevSocket)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: uffdDevSocket, Net: "unix"})
	if err != nil {
		dev.Close()
		return err
	}
	l.SetUnlinkOnClose(true)
	go func() {
		defer dev.Close()
		defer l.Close()
		l.SetDeadline(time.Now().Add(3 * lazyDeadline))
		conn, err := l.AcceptUnix()
		if err != nil {
			return
		}
		defer conn.Close()
		conn.WriteMsgUnix([]byte{0}, syscall.UnixRights(int(dev.Fd())), nil)
	}()
	return nil
}

// pidIn is the pid a pid file holds (0 if none).
func pidIn(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(string(bytes.TrimSpace(b)))
	if err != nil {
		return 0
	}
	return pid
}
