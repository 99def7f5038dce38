// Checkpoints and proofs of the broker's decision log, verified in the browser with WebCrypto.
// The same checks as broker/crypto/checkpoint.py and broker/crypto/merkle.py:
//   * a verifier key "<name>+<hex key hash>+<base64(0x01 || Ed25519 public key)>" (C2SP
//     signed-note; the key hash is SHA-256(name || "\n" || 0x01 || key)[:4]);
//   * a signed note: body, an empty line, signature lines "— <name> <base64(hash || sig)>";
//   * a tlog-checkpoint body: origin, tree size, base64 root, each line ending in "\n";
//   * RFC 9162 §2.1.3.2 inclusion and §2.1.4.2 consistency proofs (RFC 6962 hashing).
// Sizes and indexes are BigInts: the bit arithmetic of the proofs must not stop at 2^31.

const encoder = new TextEncoder();
const EM_DASH = "\u2014 ";

export class VerifyError extends Error {}

export function b64decode(text) {
  let binary;
  try {
    binary = atob(text);
  } catch {
    throw new VerifyError("not base64");
  }
  return Uint8Array.from(binary, (c) => c.charCodeAt(0));
}

export function b64encode(bytes) {
  return btoa(String.fromCharCode(...bytes));
}

function concat(...parts) {
  const total = parts.reduce((n, p) => n + p.length, 0);
  const out = new Uint8Array(total);
  let at = 0;
  for (const part of parts) {
    out.set(part, at);
    at += part.length;
  }
  return out;
}

export async function sha256(...parts) {
  return new Uint8Array(await crypto.subtle.digest("SHA-256", concat(...parts)));
}

export function equal(a, b) {
  return a.length === b.length && a.every((x, i) => x === b[i]);
}

function hex(bytes) {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

export async function parseVerifierKey(text) {
  const trimmed = text.trim();
  const first = trimmed.indexOf("+");
  const second = trimmed.indexOf("+", first + 1);
  if (first <= 0 || second < 0) throw new VerifyError("a key is <name>+<key hash>+<key>");
  const name = trimmed.slice(0, first);
  const hash = trimmed.slice(first + 1, second);
  const raw = b64decode(trimmed.slice(second + 1));
  if (raw.length !== 33 || raw[0] !== 1) throw new VerifyError("not an Ed25519 note key");
  const public_ = raw.slice(1);
  const expected = (await sha256(encoder.encode(name + "\n"), Uint8Array.of(1), public_)).slice(0, 4);
  if (hex(expected) !== hash.toLowerCase()) throw new VerifyError("the key hash does not match its name and key");
  const key = await crypto.subtle.importKey("raw", public_, { name: "Ed25519" }, false, ["verify"]);
  return { name, hash: expected, key };
}

// The note's body, if a signature line by this key verifies; else VerifyError.
export async function openNote(verifier, note) {
  if (note.length > 65536 || !note.endsWith("\n")) throw new VerifyError("not a signed note");
  const split = note.lastIndexOf("\n\n");
  if (split < 0) throw new VerifyError("a signed note has an empty line before its signatures");
  const body = note.slice(0, split + 1);
  const lines = note.slice(split + 2).split("\n").slice(0, -1);
  for (const line of lines) {
    if (!line.startsWith(EM_DASH)) throw new VerifyError("malformed signature line");
    const [name, blob] = line.slice(EM_DASH.length).split(" ");
    if (name !== verifier.name) continue;
    const raw = b64decode(blob || "");
    if (raw.length < 4 || !equal(raw.slice(0, 4), verifier.hash)) continue;
    const ok = await crypto.subtle.verify("Ed25519", verifier.key, raw.slice(4), encoder.encode(body));
    if (!ok) throw new VerifyError("the signature does not verify");
    // the other lines (witnesses' cosignatures) are named, not verified
    const cosigners = lines.filter((l) => l !== line).map((l) => l.slice(EM_DASH.length).split(" ")[0]);
    return { body, signer: verifier.name, cosigners };
  }
  throw new VerifyError(`no signature by ${verifier.name}`);
}

export function parseCheckpoint(body, origin) {
  const lines = body.split("\n");
  if (lines.length < 4 || lines[lines.length - 1] !== "") throw new VerifyError("a checkpoint has origin, size and root lines");
  const [name, sizeText, rootText] = lines;
  if (name !== origin) throw new VerifyError(`a checkpoint of ${name}, not of ${origin}`);
  if (!/^(0|[1-9][0-9]*)$/.test(sizeText)) throw new VerifyError("the tree size is not a number");
  const root = b64decode(rootText);
  if (root.length !== 32) throw new VerifyError("the root is not 32 bytes");
  return { origin: name, size: BigInt(sizeText), root };
}

export function leafHash(line) {
  return sha256(Uint8Array.of(0), line);
}

function nodeHash(left, right) {
  return sha256(Uint8Array.of(1), left, right);
}

// RFC 9162 §2.1.3.2
export async function verifyInclusion(leaf, index, size, proof, root) {
  if (!(0n <= index && index < size)) return false;
  let fn = index;
  let sn = size - 1n;
  let r = leaf;
  for (const p of proof) {
    if (sn === 0n) return false;
    if ((fn & 1n) === 1n || fn === sn) {
      r = await nodeHash(p, r);
      if ((fn & 1n) === 0n) {
        while (fn !== 0n && (fn & 1n) === 0n) {
          fn >>= 1n;
          sn >>= 1n;
        }
      }
    } else {
      r = await nodeHash(r, p);
    }
    fn >>= 1n;
    sn >>= 1n;
  }
  return sn === 0n && equal(r, root);
}

// RFC 9162 §2.1.4.2
export async function verifyConsistency(first, second, firstRoot, secondRoot, proof) {
  if (!(0n < first && first <= second)) return false;
  if (first === second) return proof.length === 0 && equal(firstRoot, secondRoot);
  if (proof.length === 0) return false;
  const path = [...proof];
  if ((first & (first - 1n)) === 0n) path.unshift(firstRoot);
  let fn = first - 1n;
  let sn = second - 1n;
  while ((fn & 1n) === 1n) {
    fn >>= 1n;
    sn >>= 1n;
  }
  let fr = path[0];
  let sr = path[0];
  for (const c of path.slice(1)) {
    if (sn === 0n) return false;
    if ((fn & 1n) === 1n || fn === sn) {
      fr = await nodeHash(c, fr);
      sr = await nodeHash(c, sr);
      if ((fn & 1n) === 0n) {
        while (fn !== 0n && (fn & 1n) === 0n) {
          fn >>= 1n;
          sn >>= 1n;
        }
      }
    } else {
      sr = await nodeHash(sr, c);
    }
    fn >>= 1n;
    sn >>= 1n;
  }
  return sn === 0n && equal(fr, firstRoot) && equal(sr, secondRoot);
}

// What this browser keeps: the pinned keys, and per log the last checkpoint it verified.
const PINS = "broker-console/pins";
const SEEN = "broker-console/seen/";

export function pins() {
  try {
    const value = JSON.parse(localStorage.getItem(PINS) || "{}");
    return value && typeof value === "object" ? value : {};
  } catch {
    return {};
  }
}

// A key is pinned once: another key for a log already pinned is refused (an auditor who means
// to replace it forgets this browser's pins first), so a page cannot swap a pin silently.
export async function pin(text) {
  const verifier = await parseVerifierKey(text);
  const pinned = pins()[verifier.name];
  if (pinned !== undefined && pinned !== text.trim()) {
    throw new VerifyError(`another key is pinned for ${verifier.name}; to replace it, forget this browser's pins first`);
  }
  localStorage.setItem(PINS, JSON.stringify({ ...pins(), [verifier.name]: text.trim() }));
  return verifier.name;
}

export function forget() {
  for (const name of Object.keys(localStorage)) {
    if (name === PINS || name.startsWith(SEEN)) localStorage.removeItem(name);
  }
}

export function seen(origin) {
  try {
    const value = JSON.parse(localStorage.getItem(SEEN + origin) || "null");
    return value ? { size: BigInt(value.size), root: b64decode(value.root), at: value.at } : null;
  } catch {
    return null;
  }
}

function remember(checkpoint) {
  const value = { size: checkpoint.size.toString(), root: b64encode(checkpoint.root), at: new Date().toISOString() };
  localStorage.setItem(SEEN + checkpoint.origin, JSON.stringify(value));
}

async function fetchText(url) {
  const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.text();
}

export async function fetchJson(url) {
  return JSON.parse(await fetchText(url));
}

// The newest checkpoint of a log, its signature checked with the pinned key (checkLog also
// checks it against the last one this browser saw: use that).
async function verifiedCheckpoint(origin, keyText) {
  const verifier = await parseVerifierKey(keyText);
  const note = await fetchText(`/v1/log/checkpoint?origin=${encodeURIComponent(origin)}`);
  const { body, signer, cosigners } = await openNote(verifier, note);
  return { ...parseCheckpoint(body, origin), signer, cosigners };
}

// Verify a log's newest checkpoint against the pin and the last one this browser saw; the
// new one is remembered only when everything verified. Returns {checkpoint, previous}.
export async function checkLog(origin, keyText) {
  const checkpoint = await verifiedCheckpoint(origin, keyText);
  const previous = seen(origin);
  if (previous !== null) {
    if (checkpoint.size < previous.size) {
      throw new VerifyError(`the log shrank: ${checkpoint.size} records, this browser saw ${previous.size}`);
    }
    if (checkpoint.size === previous.size) {
      if (!equal(checkpoint.root, previous.root)) throw new VerifyError(`another root at size ${checkpoint.size} than this browser saw`);
    } else if (previous.size > 0n) {
      const url = `/v1/log/proof/consistency?first=${previous.size}&second=${checkpoint.size}&origin=${encodeURIComponent(origin)}`;
      const proof = (await fetchJson(url)).hashes.map(b64decode);
      if (!(await verifyConsistency(previous.size, checkpoint.size, previous.root, checkpoint.root, proof))) {
        throw new VerifyError(`not consistent with the checkpoint of size ${previous.size} this browser saw`);
      }
    }
  }
  remember(checkpoint);
  return { checkpoint, previous };
}
