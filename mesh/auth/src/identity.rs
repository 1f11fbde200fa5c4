//! Who this device is ([`Identity`], [`PeerId`]) and which mesh it belongs to ([`MeshSecret`]).
//!
//! Everything per device lives in one config directory ([`default_config_dir`]):
//!
//! * `identity.key`: the long-term Ed25519 key (PKCS#8 PEM, mode 0600). The self-signed certificate
//!   is re-made from it at every start; only the key's SubjectPublicKeyInfo defines the [`PeerId`].
//! * `mesh.secret`: the mesh secret as a join code (mode 0600).

use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

/// This device's long-term key and the self-signed certificate made from it.
///
/// Made at first start by [`Identity::load_or_create`] and kept in the config directory.
pub struct Identity {
    key_der: Vec<u8>,
    cert: CertificateDer<'static>,
    peer_id: PeerId,
}

impl Identity {
    /// Loads `config_dir/identity.key`, or creates a fresh key there (mode 0600) if it is missing.
    pub fn load_or_create(config_dir: &Path) -> Result<Self, IdentityError> {
        match Self::load(config_dir) {
            Err(IdentityError::Missing { path }) => {
                let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)
                    .map_err(IdentityError::Certificate)?;
                ensure_private_dir(config_dir).map_err(|source| IdentityError::Io {
                    path: config_dir.to_owned(),
                    source,
                })?;
                write_private_file(&path, key.serialize_pem().as_bytes()).map_err(|source| {
                    IdentityError::Io {
                        path: path.clone(),
                        source,
                    }
                })?;
                info!(path = %path.display(), "created a new device identity");
                Self::from_key_pair(key)
            }
            other => other,
        }
    }

    /// Loads `config_dir/identity.key`; [`IdentityError::Missing`] when there is none (nothing is
    /// created: for commands that only look).
    pub fn load(config_dir: &Path) -> Result<Self, IdentityError> {
        let path = config_dir.join(KEY_FILE);
        let pem = match fs::read_to_string(&path) {
            Ok(pem) => pem,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(IdentityError::Missing { path });
            }
            Err(source) => return Err(IdentityError::Io { path, source }),
        };
        tighten_permissions(&path).map_err(|source| IdentityError::Io {
            path: path.clone(),
            source,
        })?;
        let key = rcgen::KeyPair::from_pem(&pem).map_err(|source| IdentityError::InvalidKey {
            path: path.clone(),
            source,
        })?;
        Self::from_key_pair(key)
    }

    /// A throw-away identity that is never stored (tests, one-shot tools).
    pub fn ephemeral() -> Result<Self, IdentityError> {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519)
            .map_err(IdentityError::Certificate)?;
        Self::from_key_pair(key)
    }

    fn from_key_pair(key: rcgen::KeyPair) -> Result<Self, IdentityError> {
        let params = rcgen::CertificateParams::new(vec![CERT_NAME.to_owned()])
            .map_err(IdentityError::Certificate)?;
        let cert = params
            .self_signed(&key)
            .map_err(IdentityError::Certificate)?;
        let cert = cert.der().clone();
        // Derive the id through the same parser the TLS verifiers use, so both always agree.
        let peer_id = PeerId::from_certificate(&cert).map_err(IdentityError::OwnCertificate)?;
        Ok(Self {
            key_der: key.serialize_der(),
            cert,
            peer_id,
        })
    }

    /// This device's id, the hash of its public key.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The self-signed certificate presented in every TLS handshake.
    pub fn certificate(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// The private key, for building TLS configs.
    pub(crate) fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print the key.
        f.debug_struct("Identity")
            .field("peer_id", &self.peer_id)
            .finish_non_exhaustive()
    }
}

/// A device's id: the first 16 bytes of the BLAKE3 hash of its certificate's
/// SubjectPublicKeyInfo DER. Shown as 26 lowercase base32 characters (RFC 4648, no padding).
#[derive(Clone, Copy, Eq, Hash, Ord, PartialEq, PartialOrd)]
pub struct PeerId([u8; 16]);

impl PeerId {
    /// Wraps raw id bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The id of the key in this SubjectPublicKeyInfo (DER, outer SEQUENCE included).
    pub fn from_spki(spki_der: &[u8]) -> Self {
        let hash = blake3::hash(spki_der);
        let mut id = [0; 16];
        id.copy_from_slice(&hash.as_bytes()[..16]);
        Self(id)
    }

    /// The id of the key a DER certificate carries.
    pub fn from_certificate(cert: &CertificateDer<'_>) -> Result<Self, rustls::Error> {
        let parsed = rustls::server::ParsedCertificate::try_from(cert)?;
        Ok(Self::from_spki(parsed.subject_public_key_info().as_ref()))
    }

    /// The raw id bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&base32_encode(&self.0))
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({self})")
    }
}

impl FromStr for PeerId {
    type Err = ParsePeerIdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bytes = base32_decode(s).ok_or(ParsePeerIdError)?;
        let id = <[u8; 16]>::try_from(bytes.as_slice()).map_err(|_| ParsePeerIdError)?;
        // Only the canonical spelling is accepted, so an id has exactly one text form.
        match base32_encode(&id) == s.to_ascii_lowercase() {
            true => Ok(Self(id)),
            false => Err(ParsePeerIdError),
        }
    }
}

impl Serialize for PeerId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // Text for human formats (JSON), raw bytes for compact ones (postcard).
        match serializer.is_human_readable() {
            true => serializer.collect_str(self),
            false => self.0.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for PeerId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match deserializer.is_human_readable() {
            true => {
                let text = String::deserialize(deserializer)?;
                text.parse().map_err(serde::de::Error::custom)
            }
            false => <[u8; 16]>::deserialize(deserializer).map(Self),
        }
    }
}

/// The shared secret that makes devices members of one mesh: 32 random bytes.
///
/// `gleam mesh init` makes one ([`MeshSecret::generate`]) and prints its [`join code`]; `gleam mesh
/// join CODE` stores it on another device. It is proved after each handshake (see [`crate::proof`])
/// and never sent.
///
/// [`join code`]: MeshSecret::join_code
#[derive(Clone, Eq, PartialEq)]
pub struct MeshSecret([u8; 32]);

impl MeshSecret {
    /// Reads `config_dir/mesh.secret`.
    pub fn load(config_dir: &Path) -> Result<Self, MeshSecretError> {
        let path = config_dir.join(SECRET_FILE);
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(MeshSecretError::Missing { path });
            }
            Err(source) => return Err(MeshSecretError::Io { path, source }),
        };
        tighten_permissions(&path).map_err(|source| MeshSecretError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_join_code(text.trim()).map_err(|source| MeshSecretError::Corrupt {
            path,
            source: Box::new(source),
        })
    }

    /// A fresh random secret.
    pub fn generate() -> Self {
        Self(rand::random())
    }

    /// Parses a join code as printed by [`MeshSecret::join_code`]; case, spaces and dashes are
    /// ignored, and a checksum catches typos.
    pub fn from_join_code(code: &str) -> Result<Self, MeshSecretError> {
        let compact: String = code
            .chars()
            .filter(|c| !c.is_whitespace() && *c != '-')
            .map(|c| c.to_ascii_lowercase())
            .collect();
        // The `gleam` prefix is optional (people may paste only the body).
        let body = match compact.strip_prefix(JOIN_CODE_PREFIX) {
            Some(body) if body.len() == JOIN_CODE_BODY_LEN => body,
            _ => &compact,
        };
        let bytes = base32_decode(body).ok_or(MeshSecretError::InvalidJoinCode(
            "not a join code (expected `gleam-` and base32 text)",
        ))?;
        if bytes.len() != 32 + CHECKSUM_LEN {
            return Err(MeshSecretError::InvalidJoinCode("wrong length"));
        }
        let (secret, checksum) = bytes.split_at(32);
        let mut out = [0; 32];
        out.copy_from_slice(secret);
        let secret = Self(out);
        if checksum != secret.checksum() {
            return Err(MeshSecretError::InvalidJoinCode(
                "checksum mismatch (a typo?)",
            ));
        }
        Ok(secret)
    }

    /// Writes the secret to `config_dir/mesh.secret` (mode 0600), replacing any previous one.
    pub fn store(&self, config_dir: &Path) -> Result<(), MeshSecretError> {
        let path = config_dir.join(SECRET_FILE);
        let mut text = self.join_code();
        text.push('\n');
        ensure_private_dir(config_dir).map_err(|source| MeshSecretError::Io {
            path: config_dir.to_owned(),
            source,
        })?;
        write_private_file(&path, text.as_bytes())
            .map_err(|source| MeshSecretError::Io { path, source })
    }

    /// The text a user types on another device to join: `gleam-` and base32 of the secret plus a
    /// 4-byte checksum, in groups of 8 (e.g. `gleam-abcdefgh-ijklmnop-…`).
    pub fn join_code(&self) -> String {
        let mut bytes = self.0.to_vec();
        bytes.extend_from_slice(&self.checksum());
        let text = base32_encode(&bytes);
        let groups: Vec<&str> = text
            .as_bytes()
            .chunks(8)
            // base32 output is ASCII, so every chunk is valid UTF-8.
            .map(|chunk| std::str::from_utf8(chunk).unwrap_or_default())
            .collect();
        format!("{JOIN_CODE_PREFIX}-{}", groups.join("-"))
    }

    /// The raw secret, as the BLAKE3 key of the membership proof.
    pub(crate) fn key(&self) -> &[u8; 32] {
        &self.0
    }

    /// A short public fingerprint (safe to show: it cannot be turned back into the secret), so
    /// users can compare meshes across devices with `gleam mesh show`.
    pub fn fingerprint(&self) -> String {
        let hash = blake3::keyed_hash(&self.0, b"gleam mesh fingerprint");
        base32_encode(&hash.as_bytes()[..5])
    }

    fn checksum(&self) -> [u8; CHECKSUM_LEN] {
        let hash = blake3::hash(&self.0);
        let mut out = [0; CHECKSUM_LEN];
        out.copy_from_slice(&hash.as_bytes()[..CHECKSUM_LEN]);
        out
    }
}

impl fmt::Debug for MeshSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MeshSecret(fingerprint {})", self.fingerprint())
    }
}

/// The directory holding everything per device: `$GLEAM_CONFIG_DIR`, else
/// `$XDG_CONFIG_HOME/gleam`, else `~/.config/gleam` (the home directory from `$HOME`, else from
/// the user database). With none of these there is no sensible default: an error says to pass
/// `--config-dir` (a directory relative to wherever the command happens to run would scatter
/// identities).
pub fn default_config_dir() -> Result<PathBuf, ConfigDirError> {
    let non_empty = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty());
    if let Some(dir) = non_empty("GLEAM_CONFIG_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = non_empty("XDG_CONFIG_HOME") {
        return Ok(PathBuf::from(dir).join("gleam"));
    }
    let home = non_empty("HOME")
        .map(PathBuf::from)
        .or_else(home_from_passwd)
        .filter(|home| home.is_absolute())
        .ok_or(ConfigDirError::NoHome)?;
    Ok(home.join(".config").join("gleam"))
}

/// The home directory of the effective user in the user database (what `~` means without `$HOME`,
/// e.g. under systemd or `env -i`).
fn home_from_passwd() -> Option<PathBuf> {
    use std::ffi::CStr;
    use std::os::unix::ffi::OsStrExt;
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    // SAFETY: `passwd` is plain data; getpwuid_r writes only into it and `buf` (whose length we
    // pass), and `result` points at `passwd` or is null when it returns.
    unsafe {
        let mut passwd: libc::passwd = std::mem::zeroed();
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwuid_r(
            libc::geteuid(),
            &raw mut passwd,
            buf.as_mut_ptr(),
            buf.len(),
            &raw mut result,
        );
        if rc != 0 || result.is_null() || passwd.pw_dir.is_null() {
            return None;
        }
        let dir = CStr::from_ptr(passwd.pw_dir).to_bytes();
        (!dir.is_empty()).then(|| PathBuf::from(std::ffi::OsStr::from_bytes(dir)))
    }
}

/// No config directory could be chosen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigDirError {
    /// Neither `$GLEAM_CONFIG_DIR`, `$XDG_CONFIG_HOME`, `$HOME` nor the user database names one.
    #[error(
        "no config directory: $HOME is not set and the user database has no home directory for \
         this user; pass --config-dir DIR or set GLEAM_CONFIG_DIR"
    )]
    NoHome,
}

/// Loading or creating the device identity failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// The certificate could not be made (or a fresh key generated).
    #[error("cannot make the device certificate")]
    Certificate(#[source] rcgen::Error),
    /// The key file exists but is not a PKCS#8 PEM key rcgen understands.
    #[error("invalid identity key in {path} (move it away to make a new identity)")]
    InvalidKey { path: PathBuf, source: rcgen::Error },
    /// Reading or writing a file in the config directory failed.
    #[error("{}", path.display())]
    Io { path: PathBuf, source: io::Error },
    /// There is no identity key yet ([`Identity::load`] does not make one).
    #[error(
        "this device has no identity yet ({} is missing); `gleam mesh init`, `gleam mesh join` or \
         `gleam peer` make one",
        path.display()
    )]
    Missing { path: PathBuf },
    /// Our own certificate did not parse (a bug: rcgen and webpki disagree).
    #[error("own certificate does not parse (rcgen and webpki disagree)")]
    OwnCertificate(#[source] rustls::Error),
}

/// Loading, parsing or storing the mesh secret failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MeshSecretError {
    /// The secret file holds something that is not a valid join code.
    #[error("corrupt mesh secret in {}", path.display())]
    Corrupt {
        path: PathBuf,
        source: Box<MeshSecretError>,
    },
    /// A join code did not parse; the text says why.
    #[error("invalid join code: {0}")]
    InvalidJoinCode(&'static str),
    /// Reading or writing the secret file failed.
    #[error("{}", path.display())]
    Io { path: PathBuf, source: io::Error },
    /// This device has no mesh secret yet.
    #[error(
        "no mesh secret at {}: run `gleam mesh init` on the first device, then \
         `gleam mesh join CODE` on the others",
        path.display()
    )]
    Missing { path: PathBuf },
}

/// A string that is not a peer id (26 base32 characters).
#[derive(Debug, thiserror::Error)]
#[error("not a peer id (expected 26 base32 characters)")]
pub struct ParsePeerIdError;

/// Creates `dir` (and parents) if needed; a directory we create is private (0700).
fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Writes `contents` to `path` atomically: a 0600 temporary file in the same directory, fsynced,
/// then renamed over `path`, so a crash never leaves a half-written key.
fn write_private_file(path: &Path, contents: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let result = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        // `mode` only applies on creation; a stale temporary file may have other bits.
        file.set_permissions(fs::Permissions::from_mode(0o600))?;
        file.write_all(contents)?;
        file.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Secrets must not be readable by others; fix the mode (with a warning) instead of refusing.
fn tighten_permissions(path: &Path) -> io::Result<()> {
    let mode = fs::metadata(path)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        warn!(
            path = %path.display(),
            mode = format!("{mode:o}"),
            "secret file readable by others; setting mode 0600"
        );
        fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
    }
    Ok(())
}

/// RFC 4648 base32, lowercase, no padding.
pub(crate) fn base32_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(5) * 8);
    let mut buffer = 0u16;
    let mut bits = 0;
    for &byte in bytes {
        buffer = (buffer << 8) | u16::from(byte);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(BASE32_ALPHABET[usize::from((buffer >> bits) & 31)] as char);
        }
        buffer &= (1 << bits) - 1;
    }
    if bits > 0 {
        out.push(BASE32_ALPHABET[usize::from((buffer << (5 - bits)) & 31)] as char);
    }
    out
}

/// Decodes [`base32_encode`]'s output (either case); `None` on any other character or on
/// non-zero trailing bits.
pub(crate) fn base32_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 5 / 8);
    let mut buffer = 0u16;
    let mut bits = 0;
    for c in text.bytes() {
        let value = match c.to_ascii_lowercase() {
            c @ b'a'..=b'z' => c - b'a',
            c @ b'2'..=b'7' => c - b'2' + 26,
            _ => return None,
        };
        buffer = (buffer << 5) | u16::from(value);
        bits += 5;
        if bits >= 8 {
            bits -= 8;
            out.push((buffer >> bits) as u8);
            buffer &= (1 << bits) - 1;
        }
    }
    // Leftover bits must be zero padding, and fewer than a whole character.
    match bits < 5 && buffer == 0 {
        true => Some(out),
        false => None,
    }
}

const BASE32_ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
const CERT_NAME: &str = "gleam.invalid";
const CHECKSUM_LEN: usize = 4;
const JOIN_CODE_PREFIX: &str = "gleam";
/// Base32 length of the secret plus checksum.
const JOIN_CODE_BODY_LEN: usize = (32 + CHECKSUM_LEN) * 8 / 5 + 1;
const KEY_FILE: &str = "identity.key";
const SECRET_FILE: &str = "mesh.secret";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base32_round_trips_and_matches_rfc4648() {
        // RFC 4648 section 10 vectors, lowercased, no padding.
        for (plain, coded) in [
            ("", ""),
            ("f", "my"),
            ("fo", "mzxq"),
            ("foo", "mzxw6"),
            ("foob", "mzxw6yq"),
            ("fooba", "mzxw6ytb"),
            ("foobar", "mzxw6ytboi"),
        ] {
            assert_eq!(base32_encode(plain.as_bytes()), coded);
            assert_eq!(base32_decode(coded).unwrap(), plain.as_bytes());
            assert_eq!(
                base32_decode(&coded.to_uppercase()).unwrap(),
                plain.as_bytes()
            );
        }
        assert!(base32_decode("mzxw6yr").is_none(), "non-zero trailing bits");
        assert!(base32_decode("mz1").is_none(), "bad character");
    }

    #[test]
    fn identity_is_created_once_with_mode_0600_and_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("cfg");
        let first = Identity::load_or_create(&config).unwrap();
        let key = config.join(KEY_FILE);
        assert_eq!(
            fs::metadata(&key).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            fs::metadata(&config).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let second = Identity::load_or_create(&config).unwrap();
        assert_eq!(first.peer_id(), second.peer_id());
        assert_eq!(
            PeerId::from_certificate(second.certificate()).unwrap(),
            second.peer_id()
        );

        let other = Identity::load_or_create(&dir.path().join("other")).unwrap();
        assert_ne!(first.peer_id(), other.peer_id());
    }

    #[test]
    fn loose_key_permissions_are_tightened() {
        let dir = tempfile::tempdir().unwrap();
        let id = Identity::load_or_create(dir.path()).unwrap();
        let key = dir.path().join(KEY_FILE);
        fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(
            Identity::load_or_create(dir.path()).unwrap().peer_id(),
            id.peer_id()
        );
        assert_eq!(
            fs::metadata(&key).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn garbage_key_is_an_error_not_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(KEY_FILE), "not a key").unwrap();
        let err = Identity::load_or_create(dir.path()).unwrap_err();
        assert!(matches!(err, IdentityError::InvalidKey { .. }), "{err}");
    }

    #[test]
    fn peer_id_text_and_serde_forms() {
        let id = Identity::ephemeral().unwrap().peer_id();
        let text = id.to_string();
        assert_eq!(text.len(), 26);
        assert!(
            text.bytes()
                .all(|c| c.is_ascii_lowercase() || (b'2'..=b'7').contains(&c))
        );
        assert_eq!(text.parse::<PeerId>().unwrap(), id);
        assert_eq!(text.to_uppercase().parse::<PeerId>().unwrap(), id);
        assert!(text[..25].parse::<PeerId>().is_err());
        assert!(format!("{text}a").parse::<PeerId>().is_err());

        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{text}\""));
        assert_eq!(serde_json::from_str::<PeerId>(&json).unwrap(), id);
        let bin = postcard::to_allocvec(&id).unwrap();
        assert_eq!(bin.len(), 16);
        assert_eq!(postcard::from_bytes::<PeerId>(&bin).unwrap(), id);
    }

    #[test]
    fn join_code_round_trips_and_catches_typos() {
        let secret = MeshSecret::generate();
        let code = secret.join_code();
        assert!(code.starts_with("gleam-"));
        assert_eq!(MeshSecret::from_join_code(&code).unwrap(), secret);
        assert_eq!(
            MeshSecret::from_join_code(&code.to_uppercase()).unwrap(),
            secret
        );
        let spaced = format!("  {}  ", code.replace('-', " "));
        assert_eq!(MeshSecret::from_join_code(&spaced).unwrap(), secret);

        // Change one character of the body: the checksum must catch it.
        let mut typo = code.clone().into_bytes();
        let last = typo.len() - 10;
        typo[last] = if typo[last] == b'a' { b'b' } else { b'a' };
        let err = MeshSecret::from_join_code(std::str::from_utf8(&typo).unwrap()).unwrap_err();
        assert!(matches!(err, MeshSecretError::InvalidJoinCode(_)), "{err}");
        assert!(MeshSecret::from_join_code("gleam-abc").is_err());
        assert!(MeshSecret::from_join_code("").is_err());
        assert!(
            !format!("{secret:?}").contains(&code[6..14]),
            "Debug must not leak the secret"
        );
    }

    #[test]
    fn secret_store_and_load_with_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let err = MeshSecret::load(dir.path()).unwrap_err();
        assert!(matches!(err, MeshSecretError::Missing { .. }), "{err}");

        let secret = MeshSecret::generate();
        secret.store(dir.path()).unwrap();
        let path = dir.path().join(SECRET_FILE);
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(MeshSecret::load(dir.path()).unwrap(), secret);

        let replacement = MeshSecret::generate();
        replacement.store(dir.path()).unwrap();
        assert_eq!(MeshSecret::load(dir.path()).unwrap(), replacement);

        fs::write(&path, "gleam-nonsense\n").unwrap();
        let err = MeshSecret::load(dir.path()).unwrap_err();
        assert!(matches!(err, MeshSecretError::Corrupt { .. }), "{err}");
    }
}
