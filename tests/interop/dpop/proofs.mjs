// Proofs from an independent DPoP implementation (panva's `dpop`, WebCrypto) for
// tests/unit/test_dpop.py. Reads one JSON request per argument: {url, method, token?, nonce?};
// prints one JSON line per request: {proof, thumbprint} (a fresh ES256 key each).
import * as DPoP from 'dpop'

for (const argument of process.argv.slice(2)) {
  const { url, method, token, nonce } = JSON.parse(argument)
  const pair = await DPoP.generateKeyPair('ES256')
  const proof = await DPoP.generateProof(pair, url, method, nonce ?? undefined, token ?? undefined)
  const thumbprint = await DPoP.calculateThumbprint(pair.publicKey)
  console.log(JSON.stringify({ proof, thumbprint }))
}
