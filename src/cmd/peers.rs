//! `gleam peers`: look at the mesh through the local daemon.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use gleam_auth::identity::{Identity, MeshSecret};
use gleam_auth::{PeerId, proof, tls};
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
        /// The peer, as ID@ADDR:PORT.
        target: String,
    },
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let config = args.config;
    match args.command {
        Command::List { json, socket } => {
            let socket = socket.unwrap_or_else(|| config.socket());
            let peers = control::list_peers(&socket)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&peers)?);
            } else {
                println!("{}", table(&peers));
            }
        }
        Command::Best {
            bytes,
            compute_secs,
            memory,
            json,
            socket,
        } => {
            let socket = socket.unwrap_or_else(|| config.socket());
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
                    let addrs: Vec<String> = best.addrs.iter().map(ToString::to_string).collect();
                    println!(
                        "{} at {} (expected {:.2} s)",
                        best.id,
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
        Command::Ping { target } => return ping(&target, &config.path()),
    }
    Ok(ExitCode::SUCCESS)
}

fn ping(target: &str, dir: &std::path::Path) -> anyhow::Result<ExitCode> {
    let (id, addr) = target.split_once('@').context("expected ID@ADDR:PORT")?;
    let id: PeerId = id.parse()?;
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("bad address {addr:?}"))?;
    let identity = Identity::load_or_create(dir)?;
    let secret = MeshSecret::load(dir)?;
    // A session connection, not a mesh one: the daemon would take a mesh connection from this
    // identity for its own daemon's link.
    let alpn = tls::ALPN_CUDA;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let bind: SocketAddr = match addr {
            SocketAddr::V4(_) => ([0, 0, 0, 0], 0).into(),
            SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let endpoint = quinn::Endpoint::client(bind)?;
        let config = tls::client_config(&identity, id, alpn)?;
        let started = Instant::now();
        let conn = tokio::time::timeout(
            Duration::from_secs(5),
            endpoint.connect_with(config, addr, &tls::server_name(id))?,
        )
        .await
        .context("handshake timed out")??;
        let handshake = started.elapsed();
        proof::authenticate_as_client(&conn, &secret).await?;
        println!(
            "{id} at {addr}: authenticated, handshake {:.1} ms, rtt {:.2} ms",
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

fn table(peers: &[PeerRow]) -> Table {
    let mut table = Table::new();
    table.load_style(UTF8_FULL_CONDENSED);
    table.set_header([
        "PEER",
        "HOST",
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
        let name = format!("{}{}", &id[..10], if peer.is_self { " (self)" } else { "" });
        let gpu = match peer.gpus.as_slice() {
            [] => "-".to_owned(),
            [one] => one.model.clone(),
            [first, ..] => format!("{} x{}", first.model, peer.gpus.len()),
        };
        table.add_row([
            name,
            peer.host.clone(),
            gpu,
            format!(
                "{:.1} / {:.1} GiB",
                gib(peer.free_memory),
                gib(peer.total_memory)
            ),
            format!(
                "{:.0}%{}",
                peer.utilization * 100.0,
                match peer.queue_len {
                    0 => String::new(),
                    n => format!(" +{n} queued"),
                }
            ),
            peer.rtt_us
                .map_or("-".into(), |us| format!("{:.2} ms", f64::from(us) / 1e3)),
            peer.bandwidth_bps
                .map_or("-".into(), |bps| format!("{:.0} Mbit/s", bps as f64 / 1e6)),
            peer.active_sessions.to_string(),
            match peer.cache.entries {
                0 => "-".into(),
                n => format!("{n} ({:.1} GiB)", gib(peer.cache.bytes)),
            },
        ]);
    }
    table
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}
