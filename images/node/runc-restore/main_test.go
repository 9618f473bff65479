package main

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"testing"
)

// A note goes to runc's log only: the stderr of a create that goes on is the container's
// own, and a note there became the first line of a woken kernel's log.
func TestANoteIsWrittenToRuncsLogAndNotToTheContainersStderr(t *testing.T) {
	log := filepath.Join(t.TempDir(), "runc.log")
	read, write, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := os.Stderr
	os.Stderr = write
	note([]string{"--log", log}, "warning", "1 of its files not put back")
	os.Stderr = stderr
	write.Close()
	said, _ := io.ReadAll(read)
	if len(said) != 0 {
		t.Fatalf("the container's stderr got %q", said)
	}
	var line map[string]string
	raw, err := os.ReadFile(log)
	if err != nil || json.Unmarshal(raw, &line) != nil {
		t.Fatalf("runc's log: %q %v", raw, err)
	}
	if line["level"] != "warning" || line["msg"] != "mcpforge-runc: 1 of its files not put back" {
		t.Fatalf("runc's log line %v", line)
	}
}
