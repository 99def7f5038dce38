//! The stock Confidential Containers guest's reading of a KBS answer, rebuilt from the crates it
//! uses, for the broker's conformance tests (tests/integration/test_kbs_conformance.py).
//!
//! Each step follows confidential-containers/guest-components (attestation-agent):
//!
//! * `decrypt JWK ANSWER`: kbs_protocol/src/client/rcar_client.rs `get_resource` parses the body
//!   as `kbs_types::Response`; kbs_protocol/src/keypair.rs `decrypt_response` unwraps the CEK
//!   (`unwrap_cek`: `RSA-OAEP-256` or `ECDH-ES+A256KW` with `epk` from the header; `enc` is never
//!   read), re-serialises the *parsed* protected header for the AAD
//!   (`ProtectedHeader::generate_aad`) and opens AES-256-GCM with the detached tag;
//!   deps/crypto/src/rust/ec.rs `unwrap_key` derives the wrapping key (Concat KDF over SHA-256,
//!   AlgorithmID "ECDH-ES+A256KW", empty PartyU/PartyV info, 256 bits) and AES-KW-unwraps.
//!   Prints the plaintext in hex.
//! * `header ANSWER`: the protected header as the guest re-serialises it (the AAD, decoded).
//! * `report-data HASH RUNTIME`: rcar_client.rs `get_composite_evidence`: JCS
//!   (serde_json_canonicalizer) of `{"tee-pubkey", "nonce", "additional-evidence"}`, hashed with
//!   the selected `kbs_types::HashAlgorithm`; attester/src/{tdx,snp}/mod.rs pad it to 64 bytes.
//! * `error-info BODY`: a non-200 body as the guest reads it (`kbs_types::ErrorInformation`).
//!
//! Exit status 0 with the result on stdout, or 1 with the reason on stderr.

// generic-array 0.14's `from_slice`, deprecated upstream, is what the guest's RustCrypto stack uses.
#![allow(deprecated)]

use std::{env, fs, process::ExitCode, str::FromStr};

use aes_gcm::{aead::AeadInPlace, Aes256Gcm, KeyInit, Nonce, Tag};
use aes_kw::KekAes256;
use base64::{engine::general_purpose::URL_SAFE_NO_PAD, Engine};
use kbs_types::{ErrorInformation, HashAlgorithm, ProtectedHeader, Response, TeePubKey};
use p256::elliptic_curve::sec1::FromEncodedPoint;
use rsa::{sha2::Sha256, BigUint, Oaep, RsaPrivateKey};
use serde_json::{json, Value};

type Result<T> = std::result::Result<T, String>;

const ECDH_ES_A256KW: &str = "ECDH-ES+A256KW";
const RSA_OAEP_256: &str = "RSA-OAEP-256";
const AES_GCM_256_KEY_BITS: u32 = 256;
const REPORT_DATA_BYTES: usize = 64;

enum GuestKey {
    P256(p256::SecretKey),
    P521(p521::SecretKey),
    Rsa(Box<RsaPrivateKey>),
}

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match argv.as_slice() {
        ["decrypt", jwk, answer] => decrypt(jwk, answer),
        ["header", answer] => header(answer),
        ["report-data", hash, runtime] => report_data(hash, runtime),
        ["error-info", body] => error_info(body),
        _ => Err(
            "usage: decrypt JWK ANSWER | header ANSWER | report-data HASH RUNTIME | \
                  error-info BODY"
                .into(),
        ),
    };
    match result {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(reason) => {
            eprintln!("{reason}");
            ExitCode::FAILURE
        }
    }
}

fn read(path: &str) -> Result<String> {
    fs::read_to_string(path).map_err(|e| format!("read {path}: {e}"))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn b64(text: &str) -> Result<Vec<u8>> {
    URL_SAFE_NO_PAD
        .decode(text)
        .map_err(|e| format!("base64url: {e}"))
}

fn member<'a>(object: &'a Value, name: &str) -> Result<&'a str> {
    object
        .get(name)
        .and_then(Value::as_str)
        .ok_or(format!("member {name} missing or not a string"))
}

fn parse_answer(path: &str) -> Result<Response> {
    // reqwest's `.json::<Response>()` is serde_json::from_slice
    serde_json::from_str(&read(path)?).map_err(|e| format!("not a kbs_types::Response: {e}"))
}

fn header(answer: &str) -> Result<String> {
    let aad = parse_answer(answer)?
        .protected
        .generate_aad()
        .map_err(|e| format!("generate_aad: {e:?}"))?;
    String::from_utf8(b64(std::str::from_utf8(&aad).map_err(|e| e.to_string())?)?)
        .map_err(|e| e.to_string())
}

fn decrypt(jwk: &str, answer: &str) -> Result<String> {
    let key = guest_key(&read(jwk)?)?;
    let response = parse_answer(answer)?;
    let cek = unwrap_cek(&key, &response.protected, &response.encrypted_key)?;
    let aad = response
        .protected
        .generate_aad()
        .map_err(|e| format!("generate_aad: {e:?}"))?;
    // deps/crypto/src/rust/aes256gcm.rs: Key/Nonce/Tag try_from refuse a wrong length
    if cek.len() != 32 || response.iv.len() != 12 || response.tag.len() != 16 {
        return Err("CEK, IV or tag has the wrong length".into());
    }
    let cipher = Aes256Gcm::new_from_slice(&cek).map_err(|e| e.to_string())?;
    let mut plaintext = response.ciphertext.clone();
    cipher
        .decrypt_in_place_detached(
            Nonce::from_slice(&response.iv),
            &aad,
            &mut plaintext,
            Tag::from_slice(&response.tag),
        )
        .map_err(|e| format!("aes-256-gcm decrypt failed: {e:?}"))?;
    Ok(hex(&plaintext))
}

fn guest_key(text: &str) -> Result<GuestKey> {
    let jwk: Value = serde_json::from_str(text).map_err(|e| format!("JWK: {e}"))?;
    let big =
        |name: &str| -> Result<BigUint> { Ok(BigUint::from_bytes_be(&b64(member(&jwk, name)?)?)) };
    match (member(&jwk, "kty")?, jwk.get("crv").and_then(Value::as_str)) {
        ("EC", Some("P-256")) => p256::SecretKey::from_slice(&b64(member(&jwk, "d")?)?)
            .map(GuestKey::P256)
            .map_err(|e| format!("P-256 d: {e}")),
        ("EC", Some("P-521")) => p521::SecretKey::from_slice(&b64(member(&jwk, "d")?)?)
            .map(GuestKey::P521)
            .map_err(|e| format!("P-521 d: {e}")),
        ("RSA", None) => RsaPrivateKey::from_components(
            big("n")?,
            big("e")?,
            big("d")?,
            vec![big("p")?, big("q")?],
        )
        .map(|k| GuestKey::Rsa(Box::new(k)))
        .map_err(|e| format!("RSA key: {e}")),
        (kty, crv) => Err(format!("unsupported private JWK {kty} {crv:?}")),
    }
}

/// keypair.rs `unwrap_cek`, for the algorithms the broker emits (RSA1_5 is not mirrored).
fn unwrap_cek(key: &GuestKey, header: &ProtectedHeader, wrapped: &[u8]) -> Result<Vec<u8>> {
    match (header.alg.as_str(), key) {
        (RSA_OAEP_256, GuestKey::Rsa(rsa_key)) => rsa_key
            .decrypt(Oaep::new::<Sha256>(), wrapped)
            .map_err(|e| format!("RSA key decrypt OAEP failed: {e:?}")),
        (RSA_OAEP_256, _) => Err("Unmatched key. Must be RSA key".into()),
        (ECDH_ES_A256KW, GuestKey::Rsa(_)) => Err("Unmatched key. Must be EC key".into()),
        (ECDH_ES_A256KW, ec_key) => {
            let epk = header
                .other_fields
                .get("epk")
                .ok_or("Invalid JWE ProtectedHeader. Without `epk`")?;
            let crv = member(epk, "crv")?;
            let (x, y) = (b64(member(epk, "x")?)?, b64(member(epk, "y")?)?);
            let z = ecdh(ec_key, crv, &x, &y)?;
            unwrap_key(&z, wrapped)
        }
        (alg, _) => Err(format!("Unsupported algorithm: {alg}")),
    }
}

/// rust/ec.rs `unwrap_key`: the shared secret with the header's `epk`.
fn ecdh(key: &GuestKey, crv: &str, x: &[u8], y: &[u8]) -> Result<Vec<u8>> {
    match (key, crv) {
        (GuestKey::P256(secret), "P-256") => {
            let point = p256::EncodedPoint::from_affine_coordinates(
                p256::FieldBytes::from_slice(fixed(x, 32)?),
                p256::FieldBytes::from_slice(fixed(y, 32)?),
                false,
            );
            let public: Option<p256::PublicKey> =
                p256::PublicKey::from_encoded_point(&point).into();
            let public = public.ok_or("invalid public key")?;
            Ok(
                p256::ecdh::diffie_hellman(secret.to_nonzero_scalar(), public.as_affine())
                    .raw_secret_bytes()
                    .to_vec(),
            )
        }
        (GuestKey::P521(secret), "P-521") => {
            let point = p521::EncodedPoint::from_affine_coordinates(
                p521::FieldBytes::from_slice(fixed(x, 66)?),
                p521::FieldBytes::from_slice(fixed(y, 66)?),
                false,
            );
            let public: Option<p521::PublicKey> =
                p521::PublicKey::from_encoded_point(&point).into();
            let public = public.ok_or("invalid public key")?;
            Ok(
                p521::ecdh::diffie_hellman(secret.to_nonzero_scalar(), public.as_affine())
                    .raw_secret_bytes()
                    .to_vec(),
            )
        }
        (_, crv) => Err(format!("Unmatched curve: {crv}")),
    }
}

fn fixed(bytes: &[u8], size: usize) -> Result<&[u8]> {
    if bytes.len() == size {
        Ok(bytes)
    } else {
        Err(format!(
            "invalid bytes length of coordinates ({} != {size})",
            bytes.len()
        ))
    }
}

fn unwrap_key(z: &[u8], wrapped: &[u8]) -> Result<Vec<u8>> {
    let mut materials = Vec::new();
    materials.extend_from_slice(&(ECDH_ES_A256KW.len() as u32).to_be_bytes());
    materials.extend_from_slice(ECDH_ES_A256KW.as_bytes());
    materials.extend_from_slice(&0_u32.to_be_bytes());
    materials.extend_from_slice(&0_u32.to_be_bytes());
    materials.extend_from_slice(&AES_GCM_256_KEY_BITS.to_be_bytes());
    let mut wrapping_key = [0_u8; 32];
    concat_kdf::derive_key_into::<Sha256>(z, &materials, &mut wrapping_key)
        .map_err(|e| format!("failed to do concat KDF: {e:?}"))?;
    if wrapped.len() < 24 {
        return Err("wrapped key too short".into());
    }
    let mut cek = vec![0_u8; wrapped.len() - 8];
    KekAes256::from(wrapping_key)
        .unwrap(wrapped, &mut cek)
        .map_err(|e| format!("failed to unwrap key: {e:?}"))?;
    Ok(cek)
}

fn report_data(hash: &str, runtime: &str) -> Result<String> {
    let input: Value = serde_json::from_str(&read(runtime)?).map_err(|e| e.to_string())?;
    // the guest holds a typed TeePubKey (keypair.rs export_pubkey), so only its members count
    let tee_pubkey: TeePubKey = serde_json::from_value(
        input
            .get("tee-pubkey")
            .cloned()
            .ok_or("tee-pubkey missing")?,
    )
    .map_err(|e| format!("tee-pubkey: {e}"))?;
    let runtime_data = json!({
        "tee-pubkey": tee_pubkey,
        "nonce": member(&input, "nonce")?,
        "additional-evidence": member(&input, "additional-evidence")?,
    });
    let canonical = serde_json_canonicalizer::to_vec(&runtime_data).map_err(|e| e.to_string())?;
    // rcar_client.rs get_hash_algorithm: the selected name, lower-cased, parsed
    let algorithm = HashAlgorithm::from_str(&hash.to_lowercase())
        .map_err(|_| format!("InvalidHashAlgorithm({hash})"))?;
    let mut digest = algorithm.digest(&canonical);
    if digest.len() > REPORT_DATA_BYTES {
        return Err("Report data must be no more than 64 bytes".into());
    }
    digest.resize(REPORT_DATA_BYTES, 0);
    Ok(hex(&digest))
}

fn error_info(body: &str) -> Result<String> {
    let info: ErrorInformation =
        serde_json::from_str(&read(body)?).map_err(|e| format!("not ErrorInformation: {e}"))?;
    serde_json::to_string(&json!({"type": info.error_type, "detail": info.detail}))
        .map_err(|e| e.to_string())
}
