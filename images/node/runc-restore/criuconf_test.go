package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// bundleWith is a bundle whose config.json holds these annotations.
func bundleWith(t *testing.T, annotations map[string]string) string {
	bundle := t.TempDir()
	raw, err := json.Marshal(map[string]any{"ociVersion": "1.0.2", "annotations": annotations})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), raw, 0o600); err != nil {
		t.Fatal(err)
	}
	return bundle
}

func annotationsOf(t *testing.T, bundle string) map[string]string {
	var s struct {
		Annotations map[string]string `json:"annotations"`
	}
	if err := readJSON(filepath.Join(bundle, "config.json"), maxSpec, &s); err != nil {
		t.Fatal(err)
	}
	return s.Annotations
}

// Every container gets CRIU's options for a kernel: its TCP connections dumped and
// restored closed, and no network lock (nothing is dumped open for it to hold still).
func TestAContainerIsGivenCRIUsOptionsForAKernel(t *testing.T) {
	bundle := bundleWith(t, map[string]string{"other": "kept"})
	if err := criuConfig(bundle, map[string]string{"other": "kept"}); err != nil {
		t.Fatal(err)
	}
	notes := annotationsOf(t, bundle)
	if notes["other"] != "kept" || notes[criuAnnotation] != filepath.Join(bundle, criuFile) {
		t.Fatalf("annotations %v", notes)
	}
	raw, err := os.ReadFile(notes[criuAnnotation])
	if err != nil {
		t.Fatal(err)
	}
	options := strings.Fields(string(raw))
	want := []string{"tcp-close", "network-lock", "skip"}
	if strings.Join(options, " ") != strings.Join(want, " ") {
		t.Fatalf("CRIU's options %q, want %q", options, want)
	}
	if info, err := os.Stat(notes[criuAnnotation]); err != nil || info.Mode().Perm() != 0o600 {
		t.Fatalf("the options file: %v %v", info, err)
	}
}

// A pod that names its own file (an annotation containerd was told to pass on) keeps it.
func TestAPodsOwnCRIUOptionsAreLeftAlone(t *testing.T) {
	own := map[string]string{criuAnnotation: "/etc/criu/theirs.conf"}
	bundle := bundleWith(t, own)
	if err := criuConfig(bundle, own); err != nil {
		t.Fatal(err)
	}
	if got := annotationsOf(t, bundle)[criuAnnotation]; got != "/etc/criu/theirs.conf" {
		t.Fatalf("annotation %q", got)
	}
	if exists(filepath.Join(bundle, criuFile)) {
		t.Fatal("an options file of ours was written beside the pod's own")
	}
}
