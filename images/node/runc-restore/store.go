package main

import (
	"bufio"
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"syscall"
)

// A snapshot kept in a claim of its session (the operator's MCPFORGE_SNAPSHOT_STORE=claim),
// so that it outlives its node and wakes on another:
//
//   - a pod annotated `store:<archive>` (the operator's store pod, on the archive's node)
//     has the archive copied into the source of its container's mount at claimMount,
//     with an HMAC of it under the nodes' shared key (MCPFORGE_SNAPSHOT_KEY), before its
//     container is made as any other (it does nothing and ends);
//   - a pod that wakes from an archive its node does not have reads the claim's copy at
//     that mount, unpacked in one read where only root reads it (no more bytes than the
//     copy holds), its HMAC computed as it is read and checked before anything of it is
//     used: whoever can write the claim (any pod of its namespace) cannot have the node's
//     CRIU read anything the nodes did not store.
//
// The files are root's, mode 0600: a kernel (a user namespace's uid) that mounts the claim
// cannot read them. A name in the claim is replaced, never written through.

const (
	storePrefix = "store:"
	claimMount  = "/.mcpforge-snapshot" // the claim's mount in a store or waking pod
	claimTar    = "snapshot.tar"
	claimMAC    = "snapshot.mac"
	keyMin      = 32 // bytes of key, at least
	copyBuffer  = 1 << 20
)

// nodeKey reads the key the nodes share, which signs what is stored.
func nodeKey() ([]byte, error) {
	path := keyPath()
	key, err := keyAt(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no snapshot key at %s: snapshots stay on their node", path)
	}
	return key, err
}

func keyPath() string { return env("MCPFORGE_SNAPSHOT_KEY", "/etc/mcp-forge/snapshot.key") }

// checkKeys are the keys a stored copy may be signed with: the nodes' key, then the one it
// replaced while the nodes still hold it (MCPFORGE_SNAPSHOT_KEY_PREVIOUS, by default the
// key's path with ".previous"): a rotation keeps the copies stored before it wakeable
// until the previous key is taken away. A previous key the handler would not take as the
// key is not taken as the previous one either; why is given to say why a copy is refused.
func checkKeys() (keys [][]byte, why string, err error) {
	key, err := nodeKey()
	if err != nil {
		return nil, "", err
	}
	path := env("MCPFORGE_SNAPSHOT_KEY_PREVIOUS", keyPath()+".previous")
	previous, perr := keyAt(path)
	switch {
	case perr == nil:
		return [][]byte{key, previous}, "", nil
	case errors.Is(perr, os.ErrNotExist):
		return [][]byte{key}, "", nil
	}
	return [][]byte{key}, fmt.Sprintf(" (the previous key was not taken: %v)", perr), nil
}

// keyAt reads a key of the nodes': a regular file of root's, readable by root only, of at
// least keyMin bytes once trimmed (an error wrapping os.ErrNotExist if there is none).
func keyAt(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("the snapshot key %s: %w", path, errors.Unwrap(err))
	}
	defer f.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return nil, err
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG || st.Uid != 0 || st.Mode&0o077 != 0 {
		return nil, fmt.Errorf("the snapshot key %s must be a regular file of root's, mode 0600", path)
	}
	key, err := io.ReadAll(io.LimitReader(f, 4096))
	if err != nil {
		return nil, err
	}
	if key = bytes.TrimSpace(key); len(key) < keyMin {
		return nil, fmt.Errorf("the snapshot key %s holds fewer than %d bytes", path, keyMin)
	}
	return key, nil
}

// macOf starts the HMAC of an archive of `namespace` named `name`: a copy is good for the
// checkpoint it was stored as, in the namespace it was taken in, and no other.
func macOf(key []byte, namespace, name string) hash.Hash {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("mcp-forge snapshot v1\x00" + namespace + "\x00" + name + "\x00"))
	return m
}

// claimDir is the node's path of the container's mount at claimMount ("" if it has none).
func claimDir(bundle string) (string, error) {
	var whole struct {
		Mounts []struct {
			Destination string `json:"destination"`
			Source      string `json:"source"`
		} `json:"mounts"`
	}
	if err := readJSON(filepath.Join(bundle, "config.json"), maxSpec, &whole); err != nil {
		return "", err
	}
	for _, m := range whole.Mounts {
		if filepath.Clean(m.Destination) == claimMount {
			return m.Source, nil
		}
	}
	return "", nil
}

// store copies the archive (scan checked it is of this pod's namespace, container and
// image) into the claim at dir, then its HMAC: each written under a name of its own, then
// renamed over what was there.
func store(archive *os.File, dir, namespace, name string) error {
	key, err := nodeKey()
	if err != nil {
		return err
	}
	info, err := archive.Stat()
	if err != nil {
		return err
	}
	if err := fits(dir, info.Size()+(1<<20)); err != nil {
		return fmt.Errorf("the session's snapshot claim: %w", err)
	}
	if _, err := archive.Seek(0, io.SeekStart); err != nil {
		return err
	}
	mac := macOf(key, namespace, name)
	tarTmp, macTmp := filepath.Join(dir, ".snapshot.tar.tmp"), filepath.Join(dir, ".snapshot.mac.tmp")
	if err := writeNew(tarTmp, func(out io.Writer) error {
		_, err := io.CopyBuffer(io.MultiWriter(out, mac), archive, make([]byte, copyBuffer))
		return err
	}); err != nil {
		return fmt.Errorf("storing %s in the session's claim: %w", name, err)
	}
	sum := hex.EncodeToString(mac.Sum(nil)) + "\n"
	if err := writeNew(macTmp, func(out io.Writer) error {
		_, err := io.WriteString(out, sum)
		return err
	}); err != nil {
		return err
	}
	if err := os.Rename(tarTmp, filepath.Join(dir, claimTar)); err != nil {
		return err
	}
	if err := os.Rename(macTmp, filepath.Join(dir, claimMAC)); err != nil {
		return err
	}
	return syncDir(dir)
}

// fromClaim extracts the claim's snapshot at dir into images (root's, in the node's
// restore directory) in one read, computing its HMAC as it reads, and gives the archive's
// spec only if the HMAC is the one stored beside it: the images the restore reads are
// what was read, which no pod can change, and nothing of an unsigned archive is used
// (its images are removed with the restore's directory, by the caller's release).
func fromClaim(dir, namespace, name, images string) (*spec, error) {
	keys, why, err := checkKeys()
	if err != nil {
		return nil, err
	}
	in, err := openRegular(filepath.Join(dir, claimTar))
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s is neither on this node nor in the session's claim (%v)", name, err)
	}
	defer in.Close()
	want, err := readMAC(filepath.Join(dir, claimMAC))
	if err != nil {
		return nil, err
	}
	info, err := in.Stat()
	if err != nil {
		return nil, err
	}
	if err := fits(filepath.Dir(images), info.Size()+headroom); err != nil {
		return nil, fmt.Errorf("checkpoint %s's images: %w", name, err)
	}
	// What is read is bounded by its size as it was found (the HMAC is of those bytes: a
	// file that grows meanwhile gains nothing), and so is what is written before the HMAC
	// is known: no more than that, on a disk where it fits, root's alone, removed if the
	// HMAC differs.
	macs, sinks := make([]hash.Hash, len(keys)), make([]io.Writer, len(keys))
	for i, key := range keys {
		macs[i] = macOf(key, namespace, name)
		sinks[i] = macs[i]
	}
	seen := io.TeeReader(bufio.NewReaderSize(io.LimitReader(in, info.Size()), copyBuffer), io.MultiWriter(sinks...))
	old, err := extractStream(seen, images, info.Size())
	_, rest := io.Copy(io.Discard, seen) // the HMAC is of every byte, the tar's end too
	if !signedBy(macs, want) {
		return nil, fmt.Errorf("the copy of checkpoint %s in the session's claim is not one this cluster's nodes stored (its HMAC differs under the nodes' key%s)", name, checkedAgainst(len(keys), why))
	}
	if err == nil {
		err = rest
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s in the session's claim: %w", name, err)
	}
	return old, nil
}

// checkedAgainst names what a refused copy was checked against, after "under the nodes' key".
func checkedAgainst(keys int, why string) string {
	if keys > 1 {
		return " and its previous one"
	}
	return why
}

// signedBy says whether one of the HMACs is want.
func signedBy(macs []hash.Hash, want []byte) bool {
	for _, mac := range macs {
		if hmac.Equal(mac.Sum(nil), want) {
			return true
		}
	}
	return false
}

// spendClaim removes the claim's copy: a checkpoint wakes one pod, once, from either copy.
func spendClaim(dir string) {
	setAside(filepath.Join(dir, claimTar))
	setAside(filepath.Join(dir, claimMAC))
}

func readMAC(path string) ([]byte, error) {
	f, err := openRegular(path)
	if err != nil {
		return nil, fmt.Errorf("the session's claim holds no HMAC of its snapshot (%v)", err)
	}
	defer f.Close()
	text, err := io.ReadAll(io.LimitReader(f, 256))
	if err != nil {
		return nil, err
	}
	sum, err := hex.DecodeString(string(bytes.TrimSpace(text)))
	if err != nil || len(sum) != sha256.Size {
		return nil, errors.New("the HMAC in the session's claim is not one")
	}
	return sum, nil
}

// openRegular opens path for reading if it is a regular file (a link is not followed, a
// FIFO not waited on).
func openRegular(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, errors.Unwrap(err)
	}
	if info, err := f.Stat(); err != nil || !info.Mode().IsRegular() {
		f.Close()
		return nil, errors.New("not a regular file")
	}
	return f, nil
}

// writeNew writes a new file at path (whatever was there removed, a link not followed),
// root's alone, synced.
func writeNew(path string, write func(io.Writer) error) error {
	os.Remove(path)
	out, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	err = write(out)
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(path)
	}
	return err
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// fits says whether `size` bytes fit on dir's filesystem.
func fits(dir string, size int64) error {
	var fs syscall.Statfs_t
	if err := syscall.Statfs(dir, &fs); err != nil {
		return err
	}
	if free := int64(fs.Bavail) * int64(fs.Bsize); size > free {
		return fmt.Errorf("%d bytes do not fit in %s (%d free)", size, dir, free)
	}
	return nil
}
