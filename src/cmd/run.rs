//! `gleam run`: runs a program with Gleam's `libcuda.so.1` in front of it, so its CUDA work executes on a
//! peer's GPU.
//!
//! The shim ([`find_shim`]) is exposed in a private temporary directory as `libcuda.so.1`, `libcuda.so`
//! and `libcuda.so.13` (the names cudart and cudarc look for), which is prepended to `LD_LIBRARY_PATH`.
//! `GLEAM_PEER` and `GLEAM_CONFIG_DIR` tell the shim where to connect and as whom.
//!
//! The peer: `--peer` names it (`<id>@HOST:PORT[,HOST:PORT...]`, or a unique id prefix or host name that
//! the local daemon knows), or the local daemon picks the best one. Every address of the peer is tried
//! (happy eyeballs), once here as a check (so an unreachable peer is a clear message from gleam rather
//! than a CUDA error deep in the program) and again by the shim, with the one that answered here first.
//! `GLEAM_PEER` is `<id>@addr,addr,...` (interface indices on link-local addresses), which the shim parses
//! with the same [`PeerAddr`] parser.
//!
//! When the daemon picks this device itself, and its GPU is a real one, the program runs on NVIDIA's
//! driver directly: no shim, no remoting, no overhead ([`runs_directly`]); the daemon counts it as a
//! session while it runs ([`control::local_session`]). `--peer` always goes through Gleam, even to
//! this device (how remoting is measured on one machine), and so does `GLEAM_DIRECT=off`.
//!
//! On a link the daemon measured as lossy (Wi-Fi, say) the program's QUIC connections use BBR rather
//! than Cubic, unless `GLEAM_CONGESTION` says otherwise ([`congestion_for`]): Cubic takes random loss
//! for congestion and falls to a tenth of such a link's rate.

use std::ffi::OsString;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use gleam_auth::PeerAddr;
use gleam_auth::identity::{Identity, MeshSecret, PeerId};
use gleam_auth::target::display_addr;
use gleam_client::Client;
use gleam_mesh::control::{self, PeerRow};
use gleam_mesh::select::JobHint;

use super::ConfigDir;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The GPU peer: `<peer-id>@HOST:PORT` (what `gleam serve` prints; several addresses may follow,
    /// comma-separated), or a peer id, a unique prefix of one, or a host name that `gleam peers list`
    /// shows. Without it, the local mesh daemon (`gleam peer`) picks the best peer.
    #[arg(long, env = "GLEAM_PEER")]
    pub peer: Option<String>,
    #[command(flatten)]
    pub config: ConfigDir,
    /// The program to run, and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<OsString>,
}

/// What a shell returns for a command it cannot find, and for one it cannot execute.
const NOT_FOUND: u8 = 127;
const NOT_EXECUTABLE: u8 = 126;

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let (program, rest) = args.command.split_first().context("no program to run")?;
    // Before anything else: a typo in the program name is not worth a trip to the mesh.
    let program = match locate_program(program) {
        Ok(path) => path,
        Err((code, why)) => {
            eprintln!("gleam: {why}");
            return Ok(ExitCode::from(code));
        }
    };
    let config_dir = args.config.path()?;
    let mut congestion = None;
    let mut stripes = None;
    let target = match args.peer {
        Some(text) => named_peer(&text, &args.config)?,
        None => {
            let socket = args.config.socket()?;
            let (target, this_gpu, link) = best_peer(&socket)?;
            let loss = link.loss;
            let direct = std::env::var("GLEAM_DIRECT").ok();
            if runs_directly(this_gpu, direct.as_deref()) {
                return run_directly(&program, rest, &socket);
            }
            let configured = std::env::var("GLEAM_CONGESTION").ok();
            congestion = congestion_for(loss, configured.as_deref());
            if let Some(cc) = congestion {
                tracing::info!(
                    loss_percent = f64::from(loss) * 100.0,
                    "the link to the GPU peer loses packets: its connections use {cc} congestion control"
                );
            }
            let configured = std::env::var("GLEAM_BULK_STRIPES").ok();
            stripes = stripes_for(link.bandwidth_bps, configured.as_deref());
            if let Some(n) = stripes {
                tracing::info!(
                    gbit_per_s = link.bandwidth_bps.unwrap_or(0) as f64 / 1e9,
                    "a fast link to the GPU peer: large copies stripe over {n} bulk connections"
                );
            }
            target
        }
    };
    let target = check_peer(target, &config_dir)?;

    let shim = find_shim()?;
    let dir = ShimDir::create(&shim)?;
    let mut library_path = OsString::from(dir.path());
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        library_path.push(":");
        library_path.push(old);
    }
    tracing::debug!(program = %program.display(), shim = %shim.display(), "running through Gleam");
    let mut command = std::process::Command::new(&program);
    if let Some(cc) = congestion {
        command.env("GLEAM_CONGESTION", cc);
    }
    if let Some(n) = stripes {
        command.env("GLEAM_BULK_STRIPES", n.to_string());
    }
    let status = command
        .args(rest)
        .env("LD_LIBRARY_PATH", library_path)
        .env("GLEAM_PEER", target.to_string())
        .env("GLEAM_CONFIG_DIR", &config_dir)
        .status()
        .with_context(|| format!("cannot start {}", program.display()))?;
    drop(dir);
    Ok(exit_code(status))
}

/// Whether a program runs on NVIDIA's driver directly: the daemon chose this device, whose GPU is a
/// real one (`this_gpu`), and `GLEAM_DIRECT` (`direct`) is not `off`.
fn runs_directly(this_gpu: bool, direct: Option<&str>) -> bool {
    this_gpu && direct.map(str::trim) != Some("off")
}

/// Loss on a link from which its connections use BBR (0.1%): at LAN round trips Cubic keeps its rate
/// below that, and falls far short of the link above it (measured: 0.5% loss, 5 ms RTT, 300 Mbit/s:
/// 4 MiB/s with Cubic, 37 MiB/s with BBR).
const LOSSY_LINK: f32 = 0.001;

/// The congestion controller `gleam run` picks for a link with `loss` (from the daemon's measurements):
/// BBR on a lossy link, unless the user chose one (`configured`: `GLEAM_CONGESTION`); `None` leaves
/// the default.
fn congestion_for(loss: f32, configured: Option<&str>) -> Option<&'static str> {
    (!user_chose(configured) && loss >= LOSSY_LINK).then_some("bbr")
}

/// Whether the user set a variable `gleam run` would otherwise set for the program (a blank value
/// counts as unset).
fn user_chose(configured: Option<&str>) -> bool {
    configured.is_some_and(|c| !c.trim().is_empty())
}

/// Measured bandwidth per bulk connection from which `gleam run` stripes large copies over several
/// (4 Gbit/s): one QUIC connection is encrypted by one thread at each end, which at Ethernet's 1500-byte
/// datagrams carried 3.9 Gbit/s of downloads on the H200 host (loopback at 1452-byte datagrams, each
/// bulk connection on a thread of its own; two stripes 7.6, four 9.4). A 1 Gbit/s LAN or Wi-Fi never
/// stripes.
const STRIPE_BANDWIDTH: u64 = 4_000_000_000;

/// How many bulk connections `gleam run` has a program stripe its large copies over on a link measured
/// at `bandwidth_bps`: one per [`STRIPE_BANDWIDTH`] (at most `MAX_STRIPES`), unless the user chose
/// (`configured`: `GLEAM_BULK_STRIPES`); `None` leaves the default, one.
fn stripes_for(bandwidth_bps: Option<u64>, configured: Option<&str>) -> Option<u8> {
    if user_chose(configured) {
        return None;
    }
    let stripes = bandwidth_bps?.div_ceil(STRIPE_BANDWIDTH);
    let max = u64::from(gleam_protocol::wire::MAX_STRIPES);
    (stripes > 1).then(|| stripes.min(max) as u8)
}

/// What the daemon measured on the link to the chosen peer.
struct LinkQuality {
    loss: f32,
    bandwidth_bps: Option<u64>,
}

/// Runs the program as it is, on this device's own driver, counted by the daemon while it runs.
fn run_directly(program: &Path, rest: &[OsString], socket: &Path) -> anyhow::Result<ExitCode> {
    // Best effort: a daemon that cannot count it does not stop the program.
    let counted = control::local_session(socket)
        .inspect_err(|err| {
            tracing::debug!(error = %gleam_auth::Chain(err), "the daemon does not count this run");
        })
        .ok();
    tracing::info!(
        "running {} on this device's GPU directly (NVIDIA's driver, no remoting)",
        program.display()
    );
    let status = std::process::Command::new(program)
        .args(rest)
        .status()
        .with_context(|| format!("cannot start {}", program.display()))?;
    drop(counted);
    Ok(exit_code(status))
}

/// The program's exit code; a signal `n` becomes `128 + n`, as shells report it.
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(code as u8),
        (None, Some(signal)) => ExitCode::from((128 + signal) as u8),
        (None, None) => ExitCode::FAILURE,
    }
}

/// The program as the shell would find it: a path as it is, a bare name through `$PATH`. Errors carry
/// the shell's exit code (127: not found, 126: not executable).
fn locate_program(program: &std::ffi::OsStr) -> Result<PathBuf, (u8, String)> {
    let shown = Path::new(program).display().to_string();
    let executable = |path: &Path| {
        path.metadata()
            .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
    };
    if program.as_encoded_bytes().contains(&b'/') {
        let path = PathBuf::from(program);
        return match path.metadata() {
            Err(_) => Err((NOT_FOUND, format!("{shown}: no such file"))),
            Ok(_) if !executable(&path) => {
                Err((NOT_EXECUTABLE, format!("{shown}: not executable")))
            }
            Ok(_) => Ok(path),
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut found_unexecutable = false;
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(program);
        if executable(&candidate) {
            return Ok(candidate);
        }
        found_unexecutable |= candidate.is_file();
    }
    match found_unexecutable {
        true => Err((NOT_EXECUTABLE, format!("{shown}: not executable"))),
        false => Err((NOT_FOUND, format!("{shown}: command not found"))),
    }
}

/// `--peer TEXT`: `<id>@addresses`, or an id, id prefix or host name the local daemon knows.
fn named_peer(text: &str, config: &ConfigDir) -> anyhow::Result<PeerAddr> {
    if text.contains('@') {
        return text.parse().with_context(|| format!("--peer {text:?}"));
    }
    let socket = config.socket()?;
    let rows = control::list_peers(&socket).map_err(|err| {
        anyhow::anyhow!(
            "--peer {text:?} names a peer by id or host name, which the local mesh daemon resolves, but it \
             did not answer ({}); start it with `gleam peer`, or give the address: --peer <peer-id>@HOST:PORT",
            gleam_auth::Chain(&err)
        )
    })?;
    let row = match_peer(text, &rows)?;
    if row.addrs.is_empty() {
        bail!(
            "the mesh knows no address of peer {} ({})",
            row.id,
            row.host
        );
    }
    Ok(PeerAddr::new(row.id, row.addrs.iter().copied()))
}

/// The one row `text` names: a full id, a unique id prefix, or a unique host name.
fn match_peer<'a>(text: &str, rows: &'a [PeerRow]) -> anyhow::Result<&'a PeerRow> {
    let wanted = text.trim().to_ascii_lowercase();
    if wanted.is_empty() {
        bail!("--peer is empty");
    }
    let by_id: Vec<&PeerRow> = rows
        .iter()
        .filter(|row| row.id.to_string().starts_with(&wanted))
        .collect();
    let by_host: Vec<&PeerRow> = rows
        .iter()
        .filter(|row| row.host.eq_ignore_ascii_case(text.trim()))
        .collect();
    let describe = |rows: &[&PeerRow]| {
        rows.iter()
            .map(|row| format!("{} ({})", row.id, row.host))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match (by_id.as_slice(), by_host.as_slice()) {
        ([one], []) | ([], [one]) => Ok(one),
        ([a], [b]) if a.id == b.id => Ok(a),
        ([], []) => bail!(
            "no peer in the mesh has an id starting with {text:?} or the host name {text:?} \
             (`gleam peers list` shows them)"
        ),
        (ids, hosts) => {
            let mut all: Vec<&PeerRow> = ids.to_vec();
            all.extend(
                hosts
                    .iter()
                    .filter(|row| !ids.iter().any(|id| id.id == row.id)),
            );
            bail!(
                "--peer {text:?} is ambiguous: it matches {}; give more of the id",
                describe(&all)
            )
        }
    }
}

/// Asks the local mesh daemon (`gleam peer`) which peer should run the job; with it, whether that is
/// this device's own real GPU, and what was measured on the link to it.
/// `socket`: the daemon of this config directory, wherever --config-dir pointed.
fn best_peer(socket: &Path) -> anyhow::Result<(PeerAddr, bool, LinkQuality)> {
    let best = control::best_peer(socket, JobHint::default()).map_err(|err| {
        anyhow::anyhow!(
            "no --peer given, and the local mesh daemon did not answer ({}); start it with \
             `gleam peer`, or pass --peer <peer-id>@HOST:PORT (printed by `gleam serve`)",
            gleam_auth::Chain(&err)
        )
    })?;
    let best = best.context(
        "the mesh knows no peer with a GPU right now (`gleam peers list` shows the members); \
         pass --peer <peer-id>@HOST:PORT to name one",
    )?;
    if best.addrs.is_empty() {
        bail!("the mesh knows no address of peer {}", best.id);
    }
    let mut why = Vec::new();
    if best.is_self {
        why.push("this device".to_owned());
    }
    if let Some(us) = best.rtt_us {
        why.push(format!("RTT {:.2} ms", f64::from(us) / 1e3));
    }
    if let Some(bps) = best.bandwidth_bps {
        why.push(format!("{:.0} Mbit/s", bps as f64 / 1e6));
    }
    if best.emulated {
        why.push("emulated GPU".to_owned());
    }
    tracing::info!(
        "chose GPU peer {} ({}){}",
        if best.host.is_empty() {
            "?"
        } else {
            &best.host
        },
        short_id(best.id),
        match why.is_empty() {
            true => String::new(),
            false => format!(": {}", why.join(", ")),
        }
    );
    let this_gpu = best.is_self && !best.emulated;
    let link = LinkQuality {
        loss: best.loss,
        bandwidth_bps: best.bandwidth_bps,
    };
    Ok((PeerAddr::new(best.id, best.addrs), this_gpu, link))
}

fn short_id(id: PeerId) -> String {
    id.to_string()[..8].to_owned()
}

/// One authenticated connection (every address tried), so that a wrong address or mesh is reported by
/// gleam itself. Returns the target with the address that answered first.
fn check_peer(mut target: PeerAddr, config_dir: &Path) -> anyhow::Result<PeerAddr> {
    let identity = Identity::load_or_create(config_dir).with_context(|| {
        format!(
            "loading this device's identity from {}",
            config_dir.display()
        )
    })?;
    let secret = MeshSecret::load(config_dir).with_context(|| {
        format!(
            "no mesh secret in {}; join the GPU peer's mesh first with `gleam mesh join CODE`",
            config_dir.display()
        )
    })?;
    let peer = target.id;
    let client = Client::connect_any(peer, &target.addrs, &identity, &secret, CHECK_TIMEOUT)
        .map_err(|err| {
            anyhow::anyhow!(
                "cannot use GPU peer {peer}: {err}\n\
                 check that `gleam serve`/`gleam peer` runs there, that the address is right, and that both \
                 devices are in the same mesh"
            )
        })?;
    let hello = client.hello();
    // A client from `connect_any` is always on the network.
    let addr = client.peer_addr();
    tracing::debug!(%peer, addr = ?addr.as_ref().map(display_addr), backend = %hello.backend, devices = hello.devices.len(), "GPU peer reachable");
    client.close(Duration::from_secs(1));
    // The shim dials in the same order: the address that answered goes first.
    if let Some(addr) = addr {
        target.prefer(addr);
    }
    Ok(target)
}

/// How long the check may take over all addresses.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// `$GLEAM_SHIM`, else `libgleamcuda.so` where the build or the install put it: beside this executable
/// (cargo's target directory, or `deps/` there), or in `../lib/gleam/` (an install under a prefix:
/// `scripts/install.sh` puts `gleam` in `PREFIX/bin` and the shim in `PREFIX/lib/gleam`).
fn find_shim() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("GLEAM_SHIM").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        if !path.is_file() {
            bail!("GLEAM_SHIM={} does not exist", path.display());
        }
        return Ok(path.canonicalize()?);
    }
    let exe = std::env::current_exe().context("cannot locate the gleam executable")?;
    // The real location (a `gleam` symlinked into PATH still finds its lib directory).
    let exe = exe.canonicalize().unwrap_or(exe);
    let dir = exe
        .parent()
        .context("the gleam executable has no directory")?;
    let candidates = shim_candidates(dir);
    // In a cargo target directory both `./` and `deps/` may hold one (a direct build and a test build):
    // the newest is the one that matches this `gleam`. An install has only one.
    let newest = candidates
        .iter()
        .filter(|p| p.is_file())
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok());
    if let Some(found) = newest {
        return Ok(found.canonicalize()?);
    }
    let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
    bail!(
        "Gleam's libcuda (libgleamcuda.so) is not installed: looked in {}; install it with \
         scripts/install.sh, build it with `cargo build -p gleam-shim`, or point GLEAM_SHIM at it",
        looked.join(", ")
    )
}

/// Where `gleam` in `exe_dir` looks for the shim.
fn shim_candidates(exe_dir: &Path) -> Vec<PathBuf> {
    let mut candidates = vec![
        exe_dir.join("libgleamcuda.so"),
        exe_dir.join("deps").join("libgleamcuda.so"),
    ];
    if let Some(prefix) = exe_dir.parent() {
        candidates.push(prefix.join("lib").join("gleam").join("libgleamcuda.so"));
    }
    candidates
}

/// A private directory of `libcuda.so*` links to the shim, removed when dropped.
struct ShimDir(PathBuf);

impl ShimDir {
    fn create(shim: &Path) -> anyhow::Result<Self> {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!("gleam-run-{}-{nonce:x}", std::process::id()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let dir = Self(path);
        for name in ["libcuda.so.1", "libcuda.so", "libcuda.so.13"] {
            std::os::unix::fs::symlink(shim, dir.0.join(name))
                .with_context(|| format!("linking {name} in {}", dir.0.display()))?;
        }
        Ok(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ShimDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gleam_mesh::state::CacheDigest;

    fn row(id: [u8; 16], host: &str) -> PeerRow {
        PeerRow {
            id: PeerId::from_bytes(id),
            is_self: false,
            host: host.to_owned(),
            gpus: Vec::new(),
            free_memory: 0,
            total_memory: 0,
            utilization: 0.0,
            active_sessions: 0,
            queue_len: 0,
            rtt_us: None,
            bandwidth_bps: None,
            loss: 0.0,
            cache: CacheDigest::default(),
            addrs: vec!["10.0.0.1:4747".parse().unwrap()],
            warnings: Vec::new(),
        }
    }

    #[test]
    fn peers_are_named_by_unique_id_prefix_or_host_name() {
        // Ids whose text forms share a first character but not a second.
        let a = row([0; 16], "gpu-box");
        let mut b_id = [0; 16];
        b_id[0] = 0x04;
        let b = row(b_id, "laptop");
        let rows = vec![a.clone(), b.clone()];
        let (a_text, b_text) = (a.id.to_string(), b.id.to_string());
        assert_eq!(&a_text[..1], &b_text[..1]);
        assert_ne!(&a_text[..2], &b_text[..2]);

        assert_eq!(match_peer(&a_text, &rows).unwrap().id, a.id);
        assert_eq!(match_peer(&b_text[..2], &rows).unwrap().id, b.id);
        assert_eq!(
            match_peer(&b_text[..2].to_uppercase(), &rows).unwrap().id,
            b.id
        );
        assert_eq!(match_peer("GPU-box", &rows).unwrap().id, a.id);
        let err = match_peer(&a_text[..1], &rows).unwrap_err().to_string();
        assert!(
            err.contains("ambiguous") && err.contains("gpu-box") && err.contains("laptop"),
            "{err}"
        );
        let err = match_peer("nothing", &rows).unwrap_err().to_string();
        assert!(err.contains("no peer"), "{err}");
        // A host name that is also a prefix of another peer's id is ambiguous, not a guess.
        let c = row([0xff; 16], &b_text[..3]);
        let err = match_peer(&b_text[..3], &[a, b, c])
            .unwrap_err()
            .to_string();
        assert!(err.contains("ambiguous"), "{err}");
    }

    #[test]
    fn only_this_devices_real_gpu_chosen_by_the_daemon_runs_directly() {
        assert!(runs_directly(true, None));
        assert!(runs_directly(true, Some("on")));
        assert!(!runs_directly(true, Some("off")));
        assert!(!runs_directly(true, Some(" off ")));
        assert!(!runs_directly(false, None));
    }

    #[test]
    fn a_lossy_link_gets_bbr_unless_the_user_chose() {
        assert_eq!(congestion_for(0.0, None), None);
        assert_eq!(congestion_for(0.0005, None), None);
        assert_eq!(congestion_for(0.005, None), Some("bbr"));
        assert_eq!(congestion_for(0.005, Some("")), Some("bbr"));
        assert_eq!(congestion_for(0.005, Some("cubic")), None);
        assert_eq!(congestion_for(0.005, Some("bbr")), None);
    }

    #[test]
    fn a_fast_link_stripes_large_copies_unless_the_user_chose() {
        let gbit = 1_000_000_000;
        assert_eq!(stripes_for(None, None), None);
        assert_eq!(stripes_for(Some(gbit), None), None);
        assert_eq!(stripes_for(Some(4 * gbit), None), None);
        assert_eq!(stripes_for(Some(5 * gbit), None), Some(2));
        assert_eq!(stripes_for(Some(10 * gbit), None), Some(3));
        assert_eq!(stripes_for(Some(100 * gbit), None), Some(4));
        assert_eq!(stripes_for(Some(10 * gbit), Some(" ")), Some(3));
        assert_eq!(stripes_for(Some(10 * gbit), Some("1")), None);
    }

    #[test]
    fn programs_are_found_as_a_shell_would_with_its_exit_codes() {
        assert!(locate_program("sh".as_ref()).is_ok());
        assert_eq!(
            locate_program("/bin/sh".as_ref()).unwrap(),
            PathBuf::from("/bin/sh")
        );
        assert_eq!(
            locate_program("gleam-no-such-program".as_ref())
                .unwrap_err()
                .0,
            NOT_FOUND
        );
        assert_eq!(
            locate_program("./no/such/file".as_ref()).unwrap_err().0,
            NOT_FOUND
        );
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("data.txt");
        std::fs::write(&plain, "x").unwrap();
        assert_eq!(
            locate_program(plain.as_os_str()).unwrap_err().0,
            NOT_EXECUTABLE
        );
    }

    #[test]
    fn the_shim_is_looked_for_beside_gleam_and_in_the_prefixes_lib_dir() {
        let candidates = shim_candidates(Path::new("/usr/local/bin"));
        assert_eq!(
            candidates,
            vec![
                PathBuf::from("/usr/local/bin/libgleamcuda.so"),
                PathBuf::from("/usr/local/bin/deps/libgleamcuda.so"),
                PathBuf::from("/usr/local/lib/gleam/libgleamcuda.so"),
            ]
        );
    }
}
