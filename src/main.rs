//! `gleam`: borrow another device's NVIDIA GPU over the LAN.
//!
//! A thin binary: every subcommand lives in `cmd/`, and the real work in the library crates
//! (`gleam-remoting`, `gleam-mesh`, `gleam-emu`, `gleam-linkemu`, `gleam-cache`).

mod cmd;
mod device_facts;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cmd::Cli::parse();
    cmd::init_tracing(cli.verbose);
    match cmd::run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("gleam: error: {err:#}");
            ExitCode::from(1)
        }
    }
}
