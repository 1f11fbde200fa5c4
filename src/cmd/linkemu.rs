//! `gleam linkemu`: relay UDP between two addresses through an emulated LAN link, so a client and
//! a peer on one machine see a real network's rate, delay, jitter and loss (where `tc netem` is
//! not available).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use gleam_linkemu::{LinkConfig, Loss, QueueLimit, Rate, Relay, parse_delay};

/// Example: `gleam linkemu --listen 127.0.0.1:7000 --to 127.0.0.1:7001 --rate 1gbit --delay 0.5ms`.
/// The link options apply to both directions; `--up-*` (towards `--to`) and `--down-*` (back to
/// the clients) override them per direction.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address the clients send to.
    #[arg(long)]
    pub listen: SocketAddr,
    /// Address datagrams are relayed to (the upstream, e.g. a peer's QUIC port).
    #[arg(long)]
    pub to: SocketAddr,
    /// Let jitter reorder datagrams (by default delivery stays in order, like a wire).
    #[arg(long)]
    pub reorder: bool,
    /// Seed of the loss and jitter random generator (the down direction uses seed + 1).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[command(flatten, next_help_heading = "Link options (both directions)")]
    pub both: LinkArgs,
    #[command(
        flatten,
        next_help_heading = "Client → upstream (overrides the link options)"
    )]
    pub up: UpArgs,
    #[command(
        flatten,
        next_help_heading = "Upstream → client (overrides the link options)"
    )]
    pub down: DownArgs,
}

/// Link options for both directions.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LinkArgs {
    /// Serialization rate: `1gbit`, `100mbit`, `500kbit` (`tc` units; `mbps` means bytes/s).
    /// Unlimited when absent.
    #[arg(long)]
    pub rate: Option<Rate>,
    /// One-way delay: `0.5ms`, `500us`, `2s`.
    #[arg(long, value_parser = parse_delay)]
    pub delay: Option<Duration>,
    /// Each datagram's delay is drawn uniformly from delay ± jitter.
    #[arg(long, value_parser = parse_delay)]
    pub jitter: Option<Duration>,
    /// Random loss: `0.01` or `1%`.
    #[arg(long)]
    pub loss: Option<Loss>,
    /// Drop-tail queue bound, as a queueing delay (`1ms`) or a size (`64KiB`), or `unlimited`.
    /// Default 1.5 MB.
    #[arg(long)]
    pub queue: Option<QueueLimit>,
}

/// Overrides for client → upstream.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct UpArgs {
    /// Rate towards `--to`.
    #[arg(long, value_name = "RATE")]
    pub up_rate: Option<Rate>,
    /// One-way delay towards `--to`.
    #[arg(long, value_name = "DELAY", value_parser = parse_delay)]
    pub up_delay: Option<Duration>,
    /// Jitter towards `--to`.
    #[arg(long, value_name = "JITTER", value_parser = parse_delay)]
    pub up_jitter: Option<Duration>,
    /// Loss towards `--to`.
    #[arg(long, value_name = "LOSS")]
    pub up_loss: Option<Loss>,
    /// Queue bound towards `--to`.
    #[arg(long, value_name = "QUEUE")]
    pub up_queue: Option<QueueLimit>,
}

/// Overrides for upstream → client.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DownArgs {
    /// Rate back to the clients.
    #[arg(long, value_name = "RATE")]
    pub down_rate: Option<Rate>,
    /// One-way delay back to the clients.
    #[arg(long, value_name = "DELAY", value_parser = parse_delay)]
    pub down_delay: Option<Duration>,
    /// Jitter back to the clients.
    #[arg(long, value_name = "JITTER", value_parser = parse_delay)]
    pub down_jitter: Option<Duration>,
    /// Loss back to the clients.
    #[arg(long, value_name = "LOSS")]
    pub down_loss: Option<Loss>,
    /// Queue bound back to the clients.
    #[arg(long, value_name = "QUEUE")]
    pub down_queue: Option<QueueLimit>,
}

impl LinkArgs {
    /// `self` with every option `over` sets replaced.
    fn overridden(&self, over: LinkArgs) -> LinkArgs {
        LinkArgs {
            rate: over.rate.or(self.rate),
            delay: over.delay.or(self.delay),
            jitter: over.jitter.or(self.jitter),
            loss: over.loss.or(self.loss),
            queue: over.queue.or(self.queue),
        }
    }

    fn config(&self, reorder: bool, seed: u64) -> LinkConfig {
        let default = LinkConfig::default();
        LinkConfig {
            rate: self.rate,
            delay: self.delay.unwrap_or(default.delay),
            jitter: self.jitter.unwrap_or(default.jitter),
            loss: self.loss.unwrap_or(default.loss),
            queue: self.queue.unwrap_or(default.queue),
            reorder,
            seed,
        }
    }
}

impl Args {
    /// The (up, down) link configurations.
    pub fn links(&self) -> (LinkConfig, LinkConfig) {
        let up = self.both.overridden(LinkArgs {
            rate: self.up.up_rate,
            delay: self.up.up_delay,
            jitter: self.up.up_jitter,
            loss: self.up.up_loss,
            queue: self.up.up_queue,
        });
        let down = self.both.overridden(LinkArgs {
            rate: self.down.down_rate,
            delay: self.down.down_delay,
            jitter: self.down.down_jitter,
            loss: self.down.down_loss,
            queue: self.down.down_queue,
        });
        (
            up.config(self.reorder, self.seed),
            down.config(self.reorder, self.seed.wrapping_add(1)),
        )
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let (up, down) = args.links();
    let relay = Relay {
        listen: args.listen,
        upstream: args.to,
        up,
        down,
    }
    .spawn()
    .context("starting the link emulator")?;
    eprintln!(
        "gleam linkemu: {} -> {}\n  up:   {up}\n  down: {down}\n(Ctrl-C or SIGTERM to stop)",
        relay.local_addr(),
        args.to
    );

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the signal handler")?;
    runtime.block_on(stop_signal())?;

    let stats = relay.stop();
    tracing::info!(%stats, "link emulator stopped");
    Ok(ExitCode::SUCCESS)
}

/// Ctrl-C, or (on Unix) SIGTERM, so that scripts which `kill` the relay still get its stats.
async fn stop_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("listening for SIGTERM")?;
        tokio::select! {
            ctrl_c = tokio::signal::ctrl_c() => ctrl_c.context("listening for Ctrl-C"),
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c()
        .await
        .context("listening for Ctrl-C")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(line: &[&str]) -> Result<Args, clap::Error> {
        let mut argv = vec![
            "linkemu",
            "--listen",
            "127.0.0.1:7000",
            "--to",
            "127.0.0.1:7001",
        ];
        argv.extend_from_slice(line);
        Cli::try_parse_from(argv).map(|cli| cli.args)
    }

    #[test]
    fn both_directions_with_overrides() {
        let args = parse(&[
            "--rate",
            "1gbit",
            "--delay",
            "0.5ms",
            "--loss",
            "1%",
            "--queue",
            "64KiB",
            "--down-rate",
            "100mbit",
            "--up-delay",
            "2ms",
        ])
        .expect("parses");
        let (up, down) = args.links();
        assert_eq!(up.rate, Rate::gbit(1));
        assert_eq!(down.rate, Rate::mbit(100));
        assert_eq!(up.delay, Duration::from_millis(2));
        assert_eq!(down.delay, Duration::from_micros(500));
        assert_eq!(up.loss, Loss::new(0.01).expect("valid"));
        assert_eq!(down.queue, QueueLimit::Bytes(65_536));
        assert_ne!(up.seed, down.seed);
    }

    #[test]
    fn bad_values_are_explained() {
        let err = parse(&["--rate", "1gbt"]).expect_err("bad unit");
        assert!(err.to_string().contains("unknown unit `gbt`"), "{err}");
        let err = parse(&["--loss", "2"]).expect_err("bad loss");
        assert!(err.to_string().contains("between 0 and 1"), "{err}");
        let err = parse(&["--delay", "5"]).expect_err("no unit");
        assert!(err.to_string().contains("invalid delay `5`"), "{err}");
    }
}
