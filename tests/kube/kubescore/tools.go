//go:build tools

package tools

import _ "github.com/zegl/kube-score/cmd/kube-score"
