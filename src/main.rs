//! `gleam`: borrow another device's NVIDIA GPU over the LAN.
//!
//! A thin binary: every subcommand lives in `cmd/`, and the real work in the library crates
//! (see the README's "How it works" table).

mod cmd;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cmd::Cli::parse_from(args());
    cmd::init_tracing(cli.verbose);
    match cmd::run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("gleam: error: {err:#}");
            ExitCode::from(1)
        }
    }
}

/// The command line, with one twist: installed (or symlinked) as `gleam-peer`, the binary is the daemon,
/// so `gleam-peer [OPTIONS]` means `gleam peer [OPTIONS]` (the name the service answers to).
fn args() -> Vec<std::ffi::OsString> {
    let mut args: Vec<_> = std::env::args_os().collect();
    let invoked_as = args
        .first()
        .and_then(|arg0| std::path::Path::new(arg0).file_name())
        .map(|name| name == "gleam-peer")
        .unwrap_or(false);
    if invoked_as {
        args.insert(1, "peer".into());
    }
    args
}
