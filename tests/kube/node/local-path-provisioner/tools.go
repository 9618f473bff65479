//go:build tools

// The provisioner's main package, required so that `go build` can build it from here.
package tools

import _ "github.com/rancher/local-path-provisioner"
