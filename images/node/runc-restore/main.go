// mcpforge-runc: the runc of a node's `mcpforge-restore` runtime handler.
//
// containerd 2.4 no longer restores a container from a checkpoint at CreateContainer
// (docs/design.md §14), so a pod that is to wake from a kubelet checkpoint runs on this
// handler instead. Every call is passed to runc as it is, except two:
//
//   - `create` of a pod's container (not its sandbox) whose spec carries the annotation
//     mcpforge.dev/restore-from (containerd passes it with the handler's pod_annotations):
//     the value names a checkpoint archive the kubelet wrote (a file name, no directory)
//     under MCPFORGE_CHECKPOINTS. The archive must be of the same namespace and image as the
//     new container. Its CRIU images are extracted into the container's bundle, given to
//     the pod's user namespace's root (who opens some of them), and `runc restore --detach`
//     brings the process back in the new container.
//   - `start` of a container restored so: it runs already; nothing to do.
//
// A refusal or a failed restore is written to runc's log, which containerd reports in the
// pod's events ("failed to create containerd task: ... mcpforge-runc: ...").
//
// Settings come from the environment (a wrapper script may set them): MCPFORGE_RUNC, the
// runc to run (/usr/sbin/runc), and MCPFORGE_CHECKPOINTS, the kubelet's checkpoint
// directory (/var/lib/kubelet/checkpoints).
package main

import (
	"archive/tar"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"
)

const (
	annotation = "mcpforge.dev/restore-from"
	marker     = "mcpforge-restored" // in the bundle of a container this program restored
	imagesDir  = "mcpforge-restore/images"
	workDir    = "mcpforge-restore/work"
	maxSpec    = 4 << 20 // spec.dump, read whole
	maxFiles   = 10000   // CRIU images in one archive
)

// An archive's name as the kubelet makes it: checkpoint-<pod>_<namespace>-<container>-<time>.tar
var archiveName = regexp.MustCompile(`^checkpoint-[A-Za-z0-9._:-]{1,400}\.tar$`)

// Flags of runc's that come before the command and take no value.
var boolFlags = map[string]bool{"--debug": true, "--systemd-cgroup": true}

type spec struct {
	Annotations map[string]string `json:"annotations"`
	Linux       struct {
		UIDMappings []idMap `json:"uidMappings"`
		GIDMappings []idMap `json:"gidMappings"`
	} `json:"linux"`
}

type idMap struct {
	ContainerID int `json:"containerID"`
	HostID      int `json:"hostID"`
	Size        int `json:"size"`
}

func main() {
	runc := env("MCPFORGE_RUNC", "/usr/sbin/runc")
	args := os.Args[1:]
	global, cmd, rest := split(args)
	var err error
	switch cmd {
	case "create":
		var restored bool
		restored, err = create(runc, global, rest)
		if err == nil && restored {
			return
		}
	case "start":
		if bundle := bundleOf(runc, global, rest); bundle != "" && exists(filepath.Join(bundle, marker)) {
			return // restored: it runs already
		}
	}
	if err != nil {
		fail(global, err)
	}
	if err := syscall.Exec(runc, append([]string{runc}, args...), os.Environ()); err != nil {
		fail(global, fmt.Errorf("exec %s: %w", runc, err))
	}
}

// split parts runc's arguments into its global flags, the command, and the command's own.
func split(args []string) (global []string, cmd string, rest []string) {
	i := 0
	for i < len(args) && strings.HasPrefix(args[i], "-") {
		if strings.Contains(args[i], "=") || boolFlags[args[i]] {
			i++
		} else {
			i += 2
		}
	}
	if i >= len(args) {
		return args, "", nil
	}
	return args[:i], args[i], args[i+1:]
}

// option is the value of `--name V` or `--name=V` among args ("" if absent).
func option(args []string, name string) string {
	for i, a := range args {
		if a == name && i+1 < len(args) {
			return args[i+1]
		}
		if strings.HasPrefix(a, name+"=") {
			return strings.TrimPrefix(a, name+"=")
		}
	}
	return ""
}

// create restores the container if its spec asks for it: true if it did.
func create(runc string, global, rest []string) (bool, error) {
	bundle := option(rest, "--bundle")
	if bundle == "" {
		bundle = option(rest, "-b")
	}
	if bundle == "" || len(rest) == 0 {
		return false, nil
	}
	var new spec
	if err := readJSON(filepath.Join(bundle, "config.json"), maxSpec, &new); err != nil {
		return false, err
	}
	name, ok := new.Annotations[annotation]
	if !ok || new.Annotations["io.kubernetes.cri.container-type"] != "container" {
		return false, nil
	}
	archive, err := checkArchive(name)
	if err != nil {
		return false, err
	}
	uid, gid := rootOf(new.Linux.UIDMappings), rootOf(new.Linux.GIDMappings)
	images := filepath.Join(bundle, imagesDir)
	old, err := extract(archive, images)
	if err != nil {
		return false, err
	}
	for _, key := range []string{"io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.image-name"} {
		if old.Annotations[key] != new.Annotations[key] {
			return false, fmt.Errorf("checkpoint %s is of %s %q, not this container's %q",
				name, key, old.Annotations[key], new.Annotations[key])
		}
	}
	if err := give(images, uid, gid); err != nil {
		return false, err
	}
	work := filepath.Join(bundle, workDir)
	if err := os.MkdirAll(work, 0o700); err != nil {
		return false, err
	}
	id := rest[len(rest)-1]
	argv := append(append([]string{}, global...), "restore", "--detach",
		"--image-path", images, "--work-path", work, "--bundle", bundle)
	if pid := option(rest, "--pid-file"); pid != "" {
		argv = append(argv, "--pid-file", pid)
	}
	if socket := option(rest, "--console-socket"); socket != "" {
		argv = append(argv, "--console-socket", socket)
	}
	if contains(rest, "--no-pivot") {
		argv = append(argv, "--no-pivot")
	}
	cmd := exec.Command(runc, append(argv, id)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		return false, fmt.Errorf("runc restore from %s: %v; CRIU said: %s", name, err,
			tail(filepath.Join(work, "restore.log"), 600))
	}
	os.RemoveAll(images) // restored: the pages live in the process now
	return true, os.WriteFile(filepath.Join(bundle, marker), nil, 0o600)
}

// checkArchive is the path of the archive `name` names, if it is a regular file of the
// kubelet's checkpoint directory.
func checkArchive(name string) (string, error) {
	if !archiveName.MatchString(name) || strings.Contains(name, "..") {
		return "", fmt.Errorf("%s=%q is not a checkpoint archive's name", annotation, name)
	}
	path := filepath.Join(env("MCPFORGE_CHECKPOINTS", "/var/lib/kubelet/checkpoints"), name)
	info, err := os.Lstat(path)
	if err != nil {
		return "", fmt.Errorf("checkpoint %s: %w", name, errors.Unwrap(err))
	}
	if !info.Mode().IsRegular() {
		return "", fmt.Errorf("checkpoint %s is not a regular file", name)
	}
	return path, nil
}

// extract writes the archive's CRIU images (checkpoint/*, regular files only) into dir,
// root's alone until they are given (give), and returns the spec the checkpointed
// container ran with.
func extract(archive, dir string) (*spec, error) {
	f, err := os.Open(archive)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	// Searchable by the namespace's root, who opens some images: the bundle is already.
	if err := os.Mkdir(filepath.Dir(dir), 0o711); err != nil && !os.IsExist(err) {
		return nil, err
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	var old *spec
	files := 0
	r := tar.NewReader(f)
	for {
		h, err := r.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("checkpoint archive: %w", err)
		}
		switch {
		case h.Name == "spec.dump":
			old = &spec{}
			if err := json.NewDecoder(io.LimitReader(r, maxSpec)).Decode(old); err != nil {
				return nil, fmt.Errorf("checkpoint archive's spec.dump: %w", err)
			}
		case strings.HasPrefix(h.Name, "checkpoint/") && h.Typeflag == tar.TypeReg:
			base := strings.TrimPrefix(h.Name, "checkpoint/")
			if base == "" || strings.ContainsAny(base, "/\x00") || base == ".." || base == "." {
				return nil, fmt.Errorf("checkpoint archive: member %q refused", h.Name)
			}
			if files++; files > maxFiles {
				return nil, fmt.Errorf("checkpoint archive: more than %d images", maxFiles)
			}
			if err := write(filepath.Join(dir, base), r); err != nil {
				return nil, err
			}
		}
	}
	if old == nil {
		return nil, fmt.Errorf("checkpoint archive has no spec.dump")
	}
	return old, nil
}

func write(path string, r io.Reader) error {
	out, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, r); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// give hands the images' directory and files (extract's, all regular) to uid:gid.
func give(dir string, uid, gid int) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.Lchown(filepath.Join(dir, e.Name()), uid, gid); err != nil {
			return err
		}
	}
	return os.Chown(dir, uid, gid)
}

// rootOf is the host id that a user namespace's mapping gives its root (0: none).
func rootOf(maps []idMap) int {
	for _, m := range maps {
		if m.ContainerID == 0 {
			return m.HostID
		}
	}
	return 0
}

// bundleOf is the bundle of the container `start` names, from `runc state` ("" if none).
func bundleOf(runc string, global, rest []string) string {
	if len(rest) == 0 {
		return ""
	}
	out, err := exec.Command(runc, append(append([]string{}, global...), "state", rest[len(rest)-1])...).Output()
	if err != nil {
		return ""
	}
	var state struct {
		Bundle string `json:"bundle"`
	}
	if json.Unmarshal(out, &state) != nil {
		return ""
	}
	return state.Bundle
}

func readJSON(path string, limit int64, into any) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return json.NewDecoder(io.LimitReader(f, limit)).Decode(into)
}

// tail is the end of a file, at most n bytes, on one line.
func tail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return "(no log)"
	}
	defer f.Close()
	if info, err := f.Stat(); err == nil && info.Size() > n {
		f.Seek(info.Size()-n, io.SeekStart)
	}
	b, _ := io.ReadAll(io.LimitReader(f, n))
	return strings.Join(strings.Fields(string(b)), " ")
}

// fail says err in runc's log, where containerd reads a failed command's reason, and on
// stderr, and exits 1.
func fail(global []string, err error) {
	msg := "mcpforge-runc: " + err.Error()
	if log := option(global, "--log"); log != "" {
		line, _ := json.Marshal(map[string]string{
			"level": "error", "msg": msg, "time": time.Now().UTC().Format(time.RFC3339Nano),
		})
		if f, e := os.OpenFile(log, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600); e == nil {
			f.Write(append(line, '\n'))
			f.Close()
		}
	}
	fmt.Fprintln(os.Stderr, msg)
	os.Exit(1)
}

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func contains(args []string, a string) bool {
	for _, x := range args {
		if x == a {
			return true
		}
	}
	return false
}
