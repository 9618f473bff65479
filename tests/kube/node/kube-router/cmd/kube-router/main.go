// The upstream main, without its pprof listener on 0.0.0.0:6060.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/cloudnativelabs/kube-router/v2/pkg/cmd"
	"github.com/cloudnativelabs/kube-router/v2/pkg/options"
	"github.com/cloudnativelabs/kube-router/v2/pkg/version"
	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
)

func main() {
	if err := run(); err != nil {
		_, _ = fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run() error {
	klog.InitFlags(nil)
	config := options.NewKubeRouterConfig()
	config.AddFlags(pflag.CommandLine)
	pflag.Parse()
	if err := flag.CommandLine.Parse([]string{}); err != nil {
		return err
	}
	if err := flag.Set("logtostderr", "true"); err != nil {
		return err
	}
	if err := flag.Set("v", config.VLevel); err != nil {
		return err
	}
	if config.HelpRequested {
		pflag.Usage()
		return nil
	}
	if config.Version {
		version.PrintVersion(false)
		return nil
	}
	if config.CleanupConfig {
		cmd.CleanupConfigAndExit()
		return nil
	}
	router, err := cmd.NewKubeRouterDefault(config)
	if err != nil {
		return fmt.Errorf("kube-router config: %w", err)
	}
	return router.Run()
}
