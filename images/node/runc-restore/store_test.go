package main

// The claim's half of the handler (store.go) against what a pod of the namespace can put
// in the claim: run by tests/unit/test_node_handler.py (`go test`), as root (the key must
// be root's).

import (
	"archive/tar"
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

const testNamespace = "team"
const testArchive = "checkpoint-ks-demo_team-kernel-2026-12-06T10:00:00Z.tar"

// archiveOf is a kubelet-like archive: spec.dump of `namespace`, two CRIU images, a log.
func archiveOf(t *testing.T, namespace string, pages int) []byte {
	t.Helper()
	var b bytes.Buffer
	w := tar.NewWriter(&b)
	add := func(name string, data []byte) {
		if err := w.WriteHeader(&tar.Header{Name: name, Mode: 0o600, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	add("spec.dump", []byte(`{"annotations":{"`+namespaceKey+`":"`+namespace+`"}}`))
	add("checkpoint/inventory.img", []byte("inventory"))
	add("checkpoint/pages-1.img", bytes.Repeat([]byte{7}, pages))
	add("dump.log", []byte("log"))
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

// setup makes the node's key, the kubelet's archive, a claim and a restore directory.
func setup(t *testing.T) (archive *os.File, claim, images string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the node's key must be root's: run as root")
	}
	dir := t.TempDir()
	key := filepath.Join(dir, "snapshot.key")
	if err := os.WriteFile(key, []byte(strings.Repeat("k", 64)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("MCPFORGE_SNAPSHOT_KEY", key)
	path := filepath.Join(dir, testArchive)
	if err := os.WriteFile(path, archiveOf(t, testNamespace, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	claim, images = filepath.Join(dir, "claim"), filepath.Join(dir, "images")
	for _, d := range []string{claim, images} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	return f, claim, images
}

func TestAStoredCopyWakesWithItsImagesAndSpecRootsAlone(t *testing.T) {
	archive, claim, images := setup(t)
	if err := store(archive, claim, testNamespace, testArchive); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{claimTar, claimMAC} {
		info, err := os.Lstat(filepath.Join(claim, name))
		if err != nil || !info.Mode().IsRegular() || info.Mode().Perm() != 0o600 {
			t.Fatalf("%s: %v %v", name, info, err)
		}
	}
	old, err := fromClaim(claim, testNamespace, testArchive, images)
	if err != nil {
		t.Fatal(err)
	}
	if old.Annotations[namespaceKey] != testNamespace {
		t.Fatalf("spec %v", old.Annotations)
	}
	pages, err := os.ReadFile(filepath.Join(images, "pages-1.img"))
	if err != nil || len(pages) != 1<<20 {
		t.Fatalf("pages: %d bytes, %v", len(pages), err)
	}
	if _, err := os.Lstat(filepath.Join(images, "dump.log")); err == nil {
		t.Fatal("only CRIU's images are unpacked")
	}
}

func TestACopyChangedOrOfAnotherCheckpointOrNamespaceIsRefused(t *testing.T) {
	archive, claim, images := setup(t)
	if err := store(archive, claim, testNamespace, testArchive); err != nil {
		t.Fatal(err)
	}
	other := strings.Replace(testArchive, "10:00:00", "11:00:00", 1)
	for _, c := range []struct{ namespace, name string }{{"elsewhere", testArchive}, {testNamespace, other}} {
		if _, err := fromClaim(claim, c.namespace, c.name, t.TempDir()); err == nil || !strings.Contains(err.Error(), "HMAC differs") {
			t.Fatalf("%v: %v", c, err)
		}
	}
	path := filepath.Join(claim, claimTar)
	data, _ := os.ReadFile(path)
	data[len(data)/2] ^= 0xff
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := fromClaim(claim, testNamespace, testArchive, images); err == nil || !strings.Contains(err.Error(), "HMAC differs") {
		t.Fatalf("changed: %v", err)
	}
}

func TestAnUnsignedArchiveIsNeverUnpackedPastItsOwnSize(t *testing.T) {
	// A member that says it is larger than the archive (a sparse one unpacks so): refused
	// before anything of it is written.
	data := archiveOf(t, testNamespace, 1<<20)
	images := t.TempDir()
	if _, err := extractStream(bytes.NewReader(data), images, 1000); err == nil {
		t.Fatal("unpacked past its budget")
	}
	if _, err := os.Lstat(filepath.Join(images, "pages-1.img")); err == nil {
		t.Fatal("the oversized member was written")
	}
}

func TestLinksFifosAndBadSignaturesInTheClaimAreRefusedWithoutWaiting(t *testing.T) {
	archive, claim, images := setup(t)
	if err := store(archive, claim, testNamespace, testArchive); err != nil {
		t.Fatal(err)
	}
	tarPath, macPath := filepath.Join(claim, claimTar), filepath.Join(claim, claimMAC)
	good, _ := os.ReadFile(tarPath)
	elsewhere := filepath.Join(t.TempDir(), "real.tar")
	os.WriteFile(elsewhere, good, 0o600)
	try := func(what string) {
		t.Helper()
		done := make(chan error, 1)
		go func() { _, err := fromClaim(claim, testNamespace, testArchive, images); done <- err }()
		select {
		case err := <-done:
			if err == nil {
				t.Fatalf("%s: taken", what)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: waited", what)
		}
	}
	os.Remove(tarPath)
	os.Symlink(elsewhere, tarPath)
	try("a link to a real archive")
	os.Remove(tarPath)
	syscall.Mkfifo(tarPath, 0o600)
	try("a FIFO")
	os.Remove(tarPath)
	os.WriteFile(tarPath, good, 0o600)
	for _, mac := range []string{"", "not hex\n", "abcd\n", strings.Repeat("0", 64) + "\n"} {
		os.WriteFile(macPath, []byte(mac), 0o600)
		try("the HMAC " + mac)
	}
	os.Remove(macPath)
	try("no HMAC")
}

func TestAStoreReplacesLinksPlantedInTheClaimAndNeverWritesThroughThem(t *testing.T) {
	archive, claim, _ := setup(t)
	victim := filepath.Join(t.TempDir(), "victim")
	os.WriteFile(victim, []byte("untouched"), 0o644)
	for _, name := range []string{".snapshot.tar.tmp", ".snapshot.mac.tmp", claimTar, claimMAC} {
		if err := os.Symlink(victim, filepath.Join(claim, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := store(archive, claim, testNamespace, testArchive); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(victim); string(got) != "untouched" {
		t.Fatalf("victim: %q", got)
	}
	for _, name := range []string{claimTar, claimMAC} {
		if info, err := os.Lstat(filepath.Join(claim, name)); err != nil || !info.Mode().IsRegular() {
			t.Fatalf("%s: %v %v", name, info, err)
		}
	}
}

func TestTheKeyMustBeRootsAloneAndLongEnough(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("run as root")
	}
	dir := t.TempDir()
	key := filepath.Join(dir, "key")
	t.Setenv("MCPFORGE_SNAPSHOT_KEY", key)
	for _, c := range []struct {
		text string
		mode os.FileMode
	}{{strings.Repeat("k", 64), 0o644}, {"short", 0o600}} {
		os.Remove(key)
		os.WriteFile(key, []byte(c.text), c.mode)
		os.Chmod(key, c.mode)
		if _, err := nodeKey(); err == nil {
			t.Fatalf("%v: taken", c)
		}
	}
	os.Remove(key)
	if _, err := nodeKey(); err == nil || !strings.Contains(err.Error(), "snapshots stay on their node") {
		t.Fatalf("missing: %v", err)
	}
}

// writeKey writes a key file of root's, 0600 (over what was there).
func writeKey(t *testing.T, path, text string, mode os.FileMode) {
	t.Helper()
	os.Remove(path)
	if err := os.WriteFile(path, []byte(text), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, mode); err != nil {
		t.Fatal(err)
	}
}

func TestACopyStoredBeforeARotationWakesWhileTheNodesHoldThePreviousKey(t *testing.T) {
	archive, claim, _ := setup(t)
	if err := store(archive, claim, testNamespace, testArchive); err != nil { // under "k" * 64
		t.Fatal(err)
	}
	key := os.Getenv("MCPFORGE_SNAPSHOT_KEY")
	previous := key + ".previous"
	wake := func() error {
		_, err := fromClaim(claim, testNamespace, testArchive, t.TempDir())
		return err
	}
	// Rotated: a new key, the old one kept as the previous: the copy still wakes.
	writeKey(t, key, strings.Repeat("n", 64), 0o600)
	writeKey(t, previous, strings.Repeat("k", 64)+"\n", 0o600)
	if err := wake(); err != nil {
		t.Fatalf("with the previous key: %v", err)
	}
	// A previous key the handler would not take as its key is not taken: refused, and why.
	for _, c := range []struct {
		text string
		mode os.FileMode
		why  string
	}{{strings.Repeat("k", 64), 0o644, "mode 0600"}, {"k", 0o600, "fewer than"}} {
		writeKey(t, previous, c.text, c.mode)
		err := wake()
		if err == nil || !strings.Contains(err.Error(), "HMAC differs") || !strings.Contains(err.Error(), c.why) {
			t.Fatalf("%v: %v", c, err)
		}
	}
	// The rotation over (the previous key gone): the old copy is refused, a new store wakes.
	os.Remove(previous)
	if err := wake(); err == nil || !strings.Contains(err.Error(), "HMAC differs") {
		t.Fatalf("without the previous key: %v", err)
	}
	if err := store(archive, claim, testNamespace, testArchive); err != nil {
		t.Fatal(err)
	}
	if err := wake(); err != nil {
		t.Fatalf("stored under the new key: %v", err)
	}
	// Signing is the new key's alone: a node that holds only the old one refuses it.
	writeKey(t, key, strings.Repeat("k", 64), 0o600)
	writeKey(t, previous, strings.Repeat("x", 64), 0o600)
	if err := wake(); err == nil || !strings.Contains(err.Error(), "HMAC differs") {
		t.Fatalf("signed under the old key: %v", err)
	}
}
