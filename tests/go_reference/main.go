// Checks the broker's signed checkpoints and Merkle proofs with the Go ecosystem's reference
// code: golang.org/x/mod/sumdb/note (signed notes) and golang.org/x/mod/sumdb/tlog (RFC 6962
// trees). Reads a JSON case on stdin; exits non-zero naming the first check that fails.
package main

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

type inclusion struct {
	Index  int64    `json:"index"`
	Record string   `json:"record"`
	Hashes []string `json:"hashes"`
}

type consistency struct {
	First     int64    `json:"first"`
	FirstRoot string   `json:"first_root"`
	Hashes    []string `json:"hashes"`
}

type input struct {
	VerifierKey string        `json:"verifier_key"`
	Checkpoint  string        `json:"checkpoint"`
	Inclusion   []inclusion   `json:"inclusion"`
	Consistency []consistency `json:"consistency"`
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
	os.Exit(1)
}

func hash(text string) tlog.Hash {
	raw, err := base64.StdEncoding.DecodeString(text)
	if err != nil || len(raw) != tlog.HashSize {
		fail("bad hash %q", text)
	}
	var h tlog.Hash
	copy(h[:], raw)
	return h
}

func hashes(texts []string) []tlog.Hash {
	out := make([]tlog.Hash, len(texts))
	for i, t := range texts {
		out[i] = hash(t)
	}
	return out
}

func main() {
	var in input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		fail("input: %v", err)
	}
	verifier, err := note.NewVerifier(in.VerifierKey)
	if err != nil {
		fail("verifier key: %v", err)
	}
	opened, err := note.Open([]byte(in.Checkpoint), note.VerifierList(verifier))
	if err != nil {
		fail("checkpoint signature: %v", err)
	}
	lines := strings.Split(opened.Text, "\n")
	if len(lines) < 4 {
		fail("checkpoint body has %d lines", len(lines))
	}
	size, err := strconv.ParseInt(lines[1], 10, 64)
	if err != nil {
		fail("checkpoint size: %v", err)
	}
	root := hash(lines[2])
	for _, c := range in.Inclusion {
		leaf := tlog.RecordHash([]byte(c.Record))
		if err := tlog.CheckRecord(tlog.RecordProof(hashes(c.Hashes)), size, root, c.Index, leaf); err != nil {
			fail("inclusion of record %d in tree %d: %v", c.Index, size, err)
		}
	}
	for _, c := range in.Consistency {
		if err := tlog.CheckTree(tlog.TreeProof(hashes(c.Hashes)), size, root, c.First, hash(c.FirstRoot)); err != nil {
			fail("consistency %d -> %d: %v", c.First, size, err)
		}
	}
	fmt.Printf("ok: origin %s, size %d, %d inclusion and %d consistency proofs\n",
		lines[0], size, len(in.Inclusion), len(in.Consistency))
}
