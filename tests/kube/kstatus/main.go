// kstatus: what sigs.k8s.io/cli-utils' kstatus (the library Flux, kpt and
// `kubectl wait`'s peers use) makes of objects. Reads a JSON array of objects on
// stdin; writes a JSON array of {"status", "message"} in the same order, with
// "Error" and the error's text for an object it cannot compute.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	data, err := io.ReadAll(io.LimitReader(os.Stdin, 64<<20))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var objs []json.RawMessage
	if err := json.Unmarshal(data, &objs); err != nil {
		fmt.Fprintln(os.Stderr, "not a JSON array of objects:", err)
		os.Exit(2)
	}
	out := make([]verdict, 0, len(objs))
	for _, raw := range objs {
		obj := &unstructured.Unstructured{}
		if err := obj.UnmarshalJSON(raw); err != nil { // numbers as the API's types
			out = append(out, verdict{"Error", err.Error()})
			continue
		}
		res, err := status.Compute(obj)
		if err != nil {
			out = append(out, verdict{"Error", err.Error()})
			continue
		}
		out = append(out, verdict{string(res.Status), res.Message})
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
}
