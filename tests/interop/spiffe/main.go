// Verifies the broker's X.509-SVIDs with go-spiffe (issue 32): an independent SPIFFE
// implementation parses the trust bundle in its JWKS form, parses the SVID with its key (which
// checks the X.509-SVID profile) and verifies the chain against the bundle.
//
// usage: spiffeverify TRUST_DOMAIN BUNDLE.jwks CHAIN.pem KEY.pem
// prints {"id": "spiffe://…"} and exits 0, or prints the error and exits 1.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"github.com/spiffe/go-spiffe/v2/bundle/spiffebundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
}

func run(args []string) error {
	if len(args) != 4 {
		return fmt.Errorf("usage: spiffeverify TRUST_DOMAIN BUNDLE.jwks CHAIN.pem KEY.pem")
	}
	td, err := spiffeid.TrustDomainFromString(args[0])
	if err != nil {
		return err
	}
	jwks, err := os.ReadFile(args[1])
	if err != nil {
		return err
	}
	bundle, err := spiffebundle.Parse(td, jwks)
	if err != nil {
		return fmt.Errorf("bundle: %w", err)
	}
	svid, err := x509svid.Load(args[2], args[3])
	if err != nil {
		return fmt.Errorf("svid: %w", err)
	}
	id, _, err := x509svid.Verify(svid.Certificates, bundle)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	out, _ := json.Marshal(map[string]string{"id": id.String()})
	fmt.Println(string(out))
	return nil
}
