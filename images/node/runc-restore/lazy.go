package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync/atomic"
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
// without /dev/userfaultfd, and a page server that does not start (the pages are then
// read before the kernel runs: restore.go).
//
// The images stay until the server has ended: it opens a task's pages when the task's
// userfaultfd comes, which the handler's return does not wait for, so the serving process
// holds a shared lock on the images' directory for as long as it lives, and what removes
// a wake's spent directories takes an exclusive one first (spent.go); so does a checkpoint
// of the container, on the restore's work directory (taken.go): CRIU dumps only the pages
// a task has. CRIU inherits both locks, so they last while either lives. A server that is
// never reached (the handler, and runc with it, killed before the restore went far) is
// ended once the handler has, with no restored kernel shown.

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
// returns once it listens, with a stop that ends it (for a restore that failed). The
// server's process holds the read end of a pipe whose write end this program keeps to its
// end: told so (EOF) before any restored kernel showed itself, it ends the server.
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
	life, alive, err := os.Pipe()
	if err != nil {
		signal.Close()
		return nil, err
	}
	defer life.Close()
	cmd := exec.Command(self, lazyFlag, images, work, pidFile)
	cmd.ExtraFiles = []*os.File{signal, life} // its 3: CRIU's --status-fd; its 4: our life
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.Dir = "/"
	if said, e := os.OpenFile(filepath.Join(work, serveLog), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600); e == nil {
		defer said.Close()
		cmd.Stderr = said
	}
	err = cmd.Start()
	signal.Close()
	if err != nil {
		alive.Close()
		return nil, fmt.Errorf("the page server: %w", err)
	}
	keepAlive = append(keepAlive, alive) // open until this program ends (close-on-exec)
	var reaped atomic.Bool
	stop = func() { // its group, CRIU too; not once reaped: the group's id may be another's
		if !reaped.Load() {
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		}
	}
	go func() { cmd.Wait(); reaped.Store(true) }()
	ready.SetReadDeadline(time.Now().Add(lazyDeadline))
	b := make([]byte, 1)
	if n, _ := ready.Read(b); n != 1 {
		stop()
		return nil, fmt.Errorf("the page server did not listen within %s; CRIU said: %s",
			lazyDeadline, tail(filepath.Join(work, lazyLog), 600))
	}
	return stop, nil
}

// keepAlive holds the write ends of the page servers' life pipes (serveLazily).
var keepAlive []*os.File

// lazyServe is the process serveLazily starts: `criu lazy-pages` as its child, told to
// write to descriptor 3 once it listens. The woken kernel (the process runc's pid file
// names) is held by a pidfd as soon as the file shows it; if CRIU ends with an error, the
// kernel is killed. The handler's end (EOF on descriptor 4) with no kernel shown ends CRIU.
func lazyServe(args []string) {
	if len(args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: mcpforge-runc "+lazyFlag+" IMAGES WORK PIDFILE")
		os.Exit(2)
	}
	images, work, pidFile := args[0], args[1], args[2]
	status, life := os.NewFile(3, "status"), os.NewFile(4, "handler")
	syscall.CloseOnExec(4) // CRIU need not hold the handler's life
	held, err := hold(images, work)
	if err != nil {
		fmt.Fprintf(os.Stderr, "mcpforge-runc: %v\n", err)
		os.Exit(1)
	}
	defer closeAll(held)
	listener, err := giveDevice(work)
	if err != nil {
		fmt.Fprintf(os.Stderr, "mcpforge-runc: %v\n", err)
		os.Exit(1)
	}
	criu := exec.Command(env("MCPFORGE_CRIU", "criu"), "lazy-pages", "--images-dir", images,
		"--work-dir", work, "--status-fd", "3", "-o", lazyLog, "-v2")
	criu.ExtraFiles = append([]*os.File{status}, held...) // the locks last while it serves
	criu.Dir = "/"
	err = criu.Start()
	status.Close()
	if err != nil { // no server: the restore fails, and the handler reads every page
		fmt.Fprintf(os.Stderr, "mcpforge-runc: %v\n", err)
		os.Exit(1)
	}
	kernel := make(chan *os.Process, 1)
	go watchHandler(life, pidFile, criu.Process, listener, kernel)
	if err = criu.Wait(); err == nil {
		return
	}
	// Until the kernel shows itself or the handler ends: a kernel that shows itself late
	// must not run on, its pages out, once this process (and its locks) are gone.
	if k := <-kernel; k != nil {
		k.Signal(syscall.SIGKILL) // by pidfd: never another process of a reused pid
		fmt.Fprintf(os.Stderr, "mcpforge-runc: the page server of %s ended (%v): the woken kernel (pid %d) was killed\n", images, err, k.Pid)
	}
	closeAll(held)
	os.Exit(1)
}

// watchHandler gives `kernel` the woken kernel's process once runc's pid file names it,
// or nil once the handler has ended (EOF on `life`) without one; then the page server,
// which no restore will reach, and the device's listener are ended.
func watchHandler(life *os.File, pidFile string, criu *os.Process, l *net.UnixListener, kernel chan<- *os.Process) {
	ended := make(chan struct{})
	go func() { io.Copy(io.Discard, life); close(ended) }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if pid := pidIn(pidFile); pid > 0 {
			// A pidfd (pidfd_open, Linux 5.3): Go falls back to the bare pid only where
			// there is none, and lazy pages need /dev/userfaultfd (Linux 6.1).
			if p, err := os.FindProcess(pid); err == nil {
				kernel <- p
				return
			}
		}
		select {
		case <-ended:
			if pidIn(pidFile) > 0 {
				continue // written as the handler ended: taken on the next turn
			}
			criu.Kill()
			l.Close()
			kernel <- nil
			return
		case <-tick.C:
		}
	}
}

// hold takes shared locks on the images' directory and the restore's work directory,
// held while the returned files are open (this process's life): the images' removal
// (spent.go) and the container's next checkpoint (taken.go) wait for them.
func hold(dirs ...string) ([]*os.File, error) {
	var held []*os.File
	for _, d := range dirs {
		f, err := os.Open(d)
		if err == nil {
			err = syscall.Flock(int(f.Fd()), syscall.LOCK_SH)
		}
		if err != nil {
			if f != nil {
				f.Close()
			}
			closeAll(held)
			return nil, err
		}
		held = append(held, f)
	}
	return held, nil
}

func closeAll(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

// giveDevice serves /dev/userfaultfd, open, once, on uffdDevSocket in work: runc restores
// from inside the container's cgroups, whose device rules refuse CRIU the device
// (images/criu/lazy-from-dev.patch). The work directory is root's alone (0700).
func giveDevice(work string) (*net.UnixListener, error) {
	dev, err := os.OpenFile("/dev/userfaultfd", os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	// A name relative to the work directory, as CRIU's: a bundle's path is longer than a
	// socket's address may be.
	if err := os.Chdir(work); err != nil {
		dev.Close()
		return nil, err
	}
	os.Remove(uffdDevSocket)
	l, err := net.ListenUnix("unix", &net.UnixAddr{Name: uffdDevSocket, Net: "unix"})
	if err != nil {
		dev.Close()
		return nil, err
	}
	l.SetUnlinkOnClose(true)
	go func() {
		defer dev.Close()
		defer l.Close()
		conn, err := l.AcceptUnix()
		if err != nil {
			return
		}
		defer conn.Close()
		conn.WriteMsgUnix([]byte{0}, syscall.UnixRights(int(dev.Fd())), nil)
	}()
	return l, nil
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
