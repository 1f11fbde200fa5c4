//! `gleam peers`: look at the mesh through the local daemon.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use gleam_auth::identity::{Identity, MeshSecret};
use gleam_auth::target::display_addr;
use gleam_auth::{PeerAddr, PeerId, dial, proof, tls};
use gleam_mesh::control::{self, PeerRow};
use gleam_mesh::select::JobHint;

/// `gleam peers [--config-dir DIR] COMMAND`.
pub type Args = super::WithConfigDir<Command>;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// List the live members of the mesh, this device first.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Control socket of the daemon (default: the one of --config-dir).
        #[arg(long)]
        socket: Option<std::path::PathBuf>,
    },
    /// Ask the daemon which peer would finish a job first.
    Best {
        /// Bytes the job moves between here and the peer.
        #[arg(long, default_value_t = JobHint::default().bytes)]
        bytes: u64,
        /// Seconds the job takes on an idle GPU.
        #[arg(long, default_value_t = JobHint::default().compute_secs)]
        compute_secs: f64,
        /// Device memory the job needs, bytes.
        #[arg(long, default_value_t = 0)]
        memory: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Control socket of the daemon (default: the one of --config-dir).
        #[arg(long)]
        socket: Option<std::path::PathBuf>,
    },
    /// Check that this device could run work on one peer: connect (gleam-cuda/1), prove
    /// membership, then hang up (diagnostics; no daemon needed).
    Ping {
        /// The peer, as ID@HOST:PORT (several addresses comma-separated; each is tried).
        target: String,
    },
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = args.config;
    match args.command {
        Command::List { json, socket } => {
            let socket = match socket {
                Some(socket) => socket,
                None => config.socket()?,
            };
            let peers = control::list_peers(&socket)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&peers)?);
            } else {
                println!("{}", render(&peers, terminal_width()));
            }
            for warning in peers
                .iter()
                .filter(|row| row.is_self)
                .flat_map(|row| &row.warnings)
            {
                eprintln!("gleam: warning: {warning}");
            }
        }
        Command::Best {
            bytes,
            compute_secs,
            memory,
            json,
            socket,
        } => {
            let socket = match socket {
                Some(socket) => socket,
                None => config.socket()?,
            };
            let best = control::best_peer(
                &socket,
                JobHint {
                    bytes,
                    compute_secs,
                    memory,
                },
            )?;
            if json {
                println!("{}", serde_json::to_string_pretty(&best)?);
            }
            match best {
                Some(best) if !json => {
                    let addrs: Vec<String> = best.addrs.iter().map(display_addr).collect();
                    println!(
                        "{} ({}) at {} (ranking figure {:.2} s)",
                        best.id,
                        best.host,
                        addrs.join(", "),
                        best.expected_secs
                    );
                }
                Some(_) => {}
                None => {
                    if !json {
                        eprintln!("no peer can take this job");
                    }
                    return Ok(ExitCode::from(3));
                }
            }
        }
        Command::Ping { target } => return ping(&target, &config.path()?),
    }
    Ok(ExitCode::SUCCESS)
}

fn ping(target: &str, dir: &std::path::Path) -> anyhow::Result<ExitCode> {
    let target: PeerAddr = target.parse()?;
    let identity = Identity::load_or_create(dir)?;
    let secret = MeshSecret::load(dir)?;
    // A session connection, not a mesh one: the daemon would take a mesh connection from this
    // identity for its own daemon's link.
    let alpn = tls::ALPN_CUDA;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let endpoint = dial::client_endpoint()?;
        let config = tls::client_config(&identity, target.id, alpn)?;
        let pace = dial::Pace {
            attempt_timeout: Duration::from_secs(5),
            ..dial::Pace::default()
        };
        let started = Instant::now();
        let dialed = dial::dial(&endpoint, &config, target.id, &target.addrs, pace).await?;
        let handshake = started.elapsed();
        let conn = dialed.conn;
        proof::authenticate_as_client(&conn, &secret).await?;
        println!(
            "{} at {}: authenticated, handshake {:.1} ms, rtt {:.2} ms",
            target.id,
            display_addr(&dialed.addr),
            handshake.as_secs_f64() * 1e3,
            conn.rtt().as_secs_f64() * 1e3
        );
        // A peer that accepts us but cannot serve closes at once; report it.
        let reason = tokio::time::timeout(Duration::from_millis(500), conn.closed()).await;
        if let Ok(reason) = reason {
            bail!("the peer closed the session: {reason}");
        }
        conn.close(0u32.into(), b"bye");
        endpoint.wait_idle().await;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The table, with full peer ids when it fits `width` (or always when `width` is `None`: not a
/// terminal, so a script or a file), else with the shortest prefixes that tell the peers apart
/// (which `gleam run --peer` accepts).
fn render(peers: &[PeerRow], width: Option<usize>) -> String {
    let full = table(peers, None).to_string();
    let Some(width) = width else { return full };
    if full.lines().all(|line| line.chars().count() <= width) {
        return full;
    }
    let prefix = unique_prefix_len(peers.iter().map(|row| row.id));
    table(peers, Some(prefix)).to_string()
}

/// The shortest prefix length (at least [`MIN_PREFIX`]) under which all `ids` differ.
fn unique_prefix_len(ids: impl Iterator<Item = PeerId>) -> usize {
    let texts: Vec<String> = ids.map(|id| id.to_string()).collect();
    let full = texts.first().map_or(MIN_PREFIX, String::len);
    (MIN_PREFIX..full)
        .find(|len| {
            let prefixes: std::collections::HashSet<&str> =
                texts.iter().map(|text| &text[..*len]).collect();
            prefixes.len() == texts.len()
        })
        .unwrap_or(full)
}

const MIN_PREFIX: usize = 6;

fn table(peers: &[PeerRow], prefix: Option<usize>) -> Table {
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED);
    table.set_header([
        "PEER",
        "HOST",
        "ADDRESS",
        "GPU",
        "MEMORY free/total",
        "LOAD",
        "RTT",
        "BANDWIDTH",
        "SESSIONS",
        "CACHED",
    ]);
    for peer in peers {
        let id = peer.id.to_string();
        let id = match prefix {
            Some(len) => &id[..len.min(id.len())],
            None => &id,
        };
        let name = format!("{id}{}", if peer.is_self { " (self)" } else { "" });
        let gpu = match peer.gpus.as_slice() {
            [] => "-".to_owned(),
            [one] => one.model.clone(),
            [first, ..] => format!("{} x{}", first.model, peer.gpus.len()),
        };
        let memory = match peer.gpus.is_empty() {
            true => "-".to_owned(),
            false => format!(
                "{} / {}",
                human_bytes(peer.free_memory),
                human_bytes(peer.total_memory)
            ),
        };
        let load = match peer.gpus.is_empty() {
            true => "-".to_owned(),
            false => format!(
                "{:.0}%{}",
                peer.utilization * 100.0,
                match peer.queue_len {
                    0 => String::new(),
                    n => format!(" +{n} queued"),
                }
            ),
        };
        table.add_row([
            name,
            peer.host.clone(),
            peer.addrs.first().map_or("-".into(), display_addr),
            gpu,
            memory,
            load,
            peer.rtt_us
                .map_or("-".into(), |us| format!("{:.2} ms", f64::from(us) / 1e3)),
            peer.bandwidth_bps.map_or("-".into(), human_rate),
            peer.active_sessions.to_string(),
            match peer.cache.entries {
                0 => "-".into(),
                n => format!("{n} ({})", human_bytes(peer.cache.bytes)),
            },
        ]);
    }
    table
}

/// Bytes in the unit that keeps 1-3 digits before the point: `1.0 MiB`, `140.5 GiB`.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    match unit {
        0 => format!("{bytes} B"),
        _ => format!("{value:.1} {}", UNITS[unit]),
    }
}

/// Bits per second as `850 kbit/s`, `94 Mbit/s`, `9.4 Gbit/s`.
fn human_rate(bps: u64) -> String {
    let bps = bps as f64;
    match bps {
        b if b >= 10e9 => format!("{:.0} Gbit/s", b / 1e9),
        b if b >= 1e9 => format!("{:.1} Gbit/s", b / 1e9),
        b if b >= 1e6 => format!("{:.0} Mbit/s", b / 1e6),
        b => format!("{:.0} kbit/s", b / 1e3),
    }
}

/// Columns of the terminal on stdout (`None` when stdout is not a terminal).
fn terminal_width() -> Option<usize> {
    use std::io::IsTerminal;
    if !std::io::stdout().is_terminal() {
        return None;
    }
    if let Some(columns) = std::env::var("COLUMNS").ok().and_then(|c| c.parse().ok()) {
        return Some(columns);
    }
    // SAFETY: `winsize` is plain integers, for which all zeroes is a valid value.
    let mut size: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ writes one `winsize` through the pointer, which points at ours.
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &raw mut size) };
    (rc == 0 && size.ws_col > 0).then_some(usize::from(size.ws_col))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gleam_mesh::state::{CacheDigest, GpuSummary};

    fn row(first: u8, host: &str, gpus: Vec<GpuSummary>) -> PeerRow {
        let mut id = [first; 16];
        id[15] = 1;
        PeerRow {
            id: PeerId::from_bytes(id),
            is_self: false,
            host: host.to_owned(),
            total_memory: gpus.iter().map(|gpu| gpu.total_memory).sum(),
            free_memory: gpus.iter().map(|gpu| gpu.total_memory).sum(),
            gpus,
            utilization: 0.0,
            active_sessions: 0,
            queue_len: 0,
            rtt_us: Some(350),
            bandwidth_bps: Some(940_000_000),
            loss: 0.0,
            cache: CacheDigest::default(),
            addrs: vec!["10.77.0.2:4747".parse().unwrap()],
            warnings: Vec::new(),
        }
    }

    fn emulated(memory: u64) -> GpuSummary {
        GpuSummary {
            model: "Gleam emulated GPU (PTX interpreter)".into(),
            total_memory: memory,
            compute_capability: (7, 5),
            emulated: true,
        }
    }

    #[test]
    fn wide_terminals_get_full_ids_and_narrow_ones_unique_prefixes() {
        let mut laptop = row(0, "laptop", Vec::new());
        laptop.is_self = true;
        laptop.addrs.clear();
        let server = row(1, "gpu-box", vec![emulated(1 << 20)]);
        let peers = vec![laptop.clone(), server.clone()];
        let full = render(&peers, None);
        assert!(full.contains(&laptop.id.to_string()), "{full}");
        assert!(full.contains(&server.id.to_string()), "{full}");
        assert!(full.contains("10.77.0.2:4747"), "{full}");
        let wide = render(&peers, Some(1000));
        assert_eq!(wide, full);

        let narrow = render(&peers, Some(100));
        assert!(!narrow.contains(&server.id.to_string()), "{narrow}");
        let len = unique_prefix_len(peers.iter().map(|row| row.id));
        assert!(narrow.contains(&server.id.to_string()[..len]), "{narrow}");
        assert!(len >= MIN_PREFIX);

        // Memory only where there is a GPU, in a unit that shows it.
        let line =
            |text: &str, host: &str| text.lines().find(|l| l.contains(host)).unwrap().to_owned();
        assert!(
            line(&full, "gpu-box").contains("1.0 MiB / 1.0 MiB"),
            "{full}"
        );
        assert!(!line(&full, "laptop").contains("GiB"), "{full}");
        assert!(line(&full, "gpu-box").contains("940 Mbit/s"), "{full}");
    }

    #[test]
    fn prefixes_grow_until_ids_differ() {
        let a = PeerId::from_bytes([0; 16]);
        let mut b = [0; 16];
        b[5] = 1;
        let b = PeerId::from_bytes(b);
        let len = unique_prefix_len([a, b].into_iter());
        assert_ne!(a.to_string()[..len], b.to_string()[..len]);
        assert_eq!(a.to_string()[..len - 1], b.to_string()[..len - 1]);
        assert_eq!(unique_prefix_len([a].into_iter()), MIN_PREFIX);
    }

    #[test]
    fn sizes_and_rates_read_naturally() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1 << 20), "1.0 MiB");
        assert_eq!(human_bytes(141 << 30), "141.0 GiB");
        assert_eq!(human_rate(850_000), "850 kbit/s");
        assert_eq!(human_rate(94_000_000), "94 Mbit/s");
        assert_eq!(human_rate(9_400_000_000), "9.4 Gbit/s");
    }
}
