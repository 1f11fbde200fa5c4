//! `--config-dir DIR` (env `GLEAM_CONFIG_DIR`) means the same in every subcommand: the identity and
//! mesh secret live there, and so does the daemon's control socket unless `--socket` says otherwise.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use common::netns::{Proc, wait_for};
use common::{gleam, output_within, text};

const LIMIT: Duration = Duration::from_secs(20);

/// `gleam ARGS` with no `GLEAM_CONFIG_DIR` inherited from the developer's shell.
fn gleam_cmd(args: &[&str]) -> Command {
    let mut command = Command::new(gleam());
    command
        .args(args)
        .env_remove("GLEAM_CONFIG_DIR")
        .env("GLEAM_LOG", "warn");
    command
}

fn ok(command: Command) -> Output {
    let out = output_within(command, LIMIT);
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

fn show(command: Command) -> serde_json::Value {
    serde_json::from_slice(&ok(command).stdout).expect("mesh show --json prints JSON")
}

fn arg(path: &Path) -> &str {
    path.to_str().expect("temp paths are UTF-8")
}

#[test]
fn mesh_takes_the_flag_and_the_flag_beats_the_environment() {
    let temp = tempfile::tempdir().unwrap();
    let (flag, env) = (temp.path().join("flag"), temp.path().join("env"));

    // The flag before or after the subcommand.
    ok(gleam_cmd(&["mesh", "--config-dir", arg(&flag), "init"]));
    assert!(flag.join("mesh.secret").is_file());
    assert!(flag.join("identity.key").is_file());
    let by_flag = show(gleam_cmd(&[
        "mesh",
        "show",
        "--json",
        "--config-dir",
        arg(&flag),
    ]));
    assert_eq!(by_flag["config_dir"], arg(&flag));
    assert!(by_flag["mesh_fingerprint"].is_string(), "{by_flag}");

    let mut both = gleam_cmd(&["mesh", "show", "--json", "--config-dir", arg(&flag)]);
    both.env("GLEAM_CONFIG_DIR", &env);
    assert_eq!(show(both)["config_dir"], arg(&flag));

    let mut by_env = gleam_cmd(&["mesh", "show", "--json"]);
    by_env.env("GLEAM_CONFIG_DIR", &env);
    let by_env = show(by_env);
    assert_eq!(by_env["config_dir"], arg(&env));
    assert!(by_env["mesh_fingerprint"].is_null(), "{by_env}");
}

#[test]
fn peers_finds_the_daemon_of_its_config_dir() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("cfg");
    ok(gleam_cmd(&["mesh", "init", "--config-dir", arg(&dir)]));

    // No daemon yet: the error names the socket inside the config dir.
    let out = output_within(
        gleam_cmd(&["peers", "list", "--config-dir", arg(&dir)]),
        LIMIT,
    );
    assert!(!out.status.success());
    let socket = dir.join("daemon.sock");
    assert!(
        text(&out.stderr).contains(arg(&socket)),
        "{}",
        text(&out.stderr)
    );

    // Content this device already holds is advertised with its GPU facts.
    let store = gleam_cache::BlobStore::open(dir.join("cache"), 1 << 30).unwrap();
    store.put(b"a module image").unwrap();
    store.put(b"some weights").unwrap();

    let daemon = Proc::spawn(
        gleam_cmd(&[
            "peer",
            "--no-mdns",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "emu",
            "--config-dir",
            arg(&dir),
        ]),
        temp.path().join("peer.log"),
    );
    let rows = wait_for(LIMIT, || {
        let out = output_within(
            gleam_cmd(&["peers", "--config-dir", arg(&dir), "list", "--json"]),
            LIMIT,
        );
        out.status
            .success()
            .then(|| serde_json::from_slice::<serde_json::Value>(&out.stdout).ok())
            .flatten()
    })
    .unwrap_or_else(|| panic!("the daemon never answered:\n{}", daemon.log_text()));
    let me = show(gleam_cmd(&[
        "mesh",
        "show",
        "--json",
        "--config-dir",
        arg(&dir),
    ]));
    let rows = rows.as_array().expect("a list of peers");
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["id"], me["peer_id"], "{rows:?}");
    assert_eq!(rows[0]["cache"]["entries"], 2, "{rows:?}");
    assert_eq!(rows[0]["cache"]["bytes"], 26, "{rows:?}");
}

/// Issue 10, item 9: `gleam mesh show` only looks; it makes no identity.
#[test]
fn mesh_show_creates_nothing() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("empty");
    let shown = show(gleam_cmd(&[
        "mesh",
        "show",
        "--json",
        "--config-dir",
        arg(&dir),
    ]));
    assert!(shown["peer_id"].is_null(), "{shown}");
    assert!(
        !dir.join("identity.key").exists(),
        "mesh show made an identity"
    );
    let out = ok(gleam_cmd(&["mesh", "show", "--config-dir", arg(&dir)]));
    assert!(
        text(&out.stdout).contains("none yet"),
        "{}",
        text(&out.stdout)
    );
    // Once there is one, it is shown.
    ok(gleam_cmd(&["mesh", "init", "--config-dir", arg(&dir)]));
    let shown = show(gleam_cmd(&[
        "mesh",
        "show",
        "--json",
        "--config-dir",
        arg(&dir),
    ]));
    assert!(shown["peer_id"].is_string(), "{shown}");
}

/// Issue 10, item 9: without `$HOME` the config directory is the user's home from the user database, never
/// `.gleam` in whatever directory the command runs in.
#[test]
fn no_home_means_the_user_databases_home_not_the_current_directory() {
    let temp = tempfile::tempdir().unwrap();
    let mut command = gleam_cmd(&["mesh", "show", "--json"]);
    command
        .current_dir(temp.path())
        .env_remove("HOME")
        .env_remove("XDG_CONFIG_HOME");
    let shown = show(command);
    let dir = shown["config_dir"].as_str().expect("a config dir");
    assert!(Path::new(dir).is_absolute(), "{dir}");
    assert!(dir.ends_with(".config/gleam"), "{dir}");
    assert!(!temp.path().join(".gleam").exists());
}

/// Issue 10, item 9: a program that does not exist is the shell's 127 (126: not executable), at once and
/// without asking any daemon.
#[test]
fn gleam_run_of_a_missing_program_exits_127_without_a_daemon() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("cfg");
    let started = std::time::Instant::now();
    let out = output_within(
        gleam_cmd(&[
            "run",
            "--config-dir",
            arg(&dir),
            "--",
            "gleam-no-such-program",
        ]),
        LIMIT,
    );
    assert_eq!(out.status.code(), Some(127), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("command not found"),
        "{}",
        text(&out.stderr)
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        !dir.exists(),
        "nothing was set up for a program that cannot run"
    );
    let data = temp.path().join("data.txt");
    std::fs::write(&data, "not a program").unwrap();
    let out = output_within(gleam_cmd(&["run", "--", arg(&data)]), LIMIT);
    assert_eq!(out.status.code(), Some(126), "{}", text(&out.stderr));
}

/// Issue 10, item 6: logs carry no colour codes when stderr is not a terminal, and an OS error is
/// printed once.
#[test]
fn logs_to_a_file_have_no_colour_and_os_errors_are_said_once() {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("cfg");
    let mut command = gleam_cmd(&["mesh", "init", "--config-dir", arg(&dir)]);
    command.env("GLEAM_LOG", "info");
    let out = ok(command);
    let stderr = text(&out.stderr);
    assert!(stderr.contains("created a new device identity"), "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "colour codes in {stderr:?}");

    let out = output_within(
        gleam_cmd(&["peers", "list", "--config-dir", arg(&dir)]),
        LIMIT,
    );
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(stderr.matches("os error 2").count(), 1, "{stderr}");
    assert!(stderr.contains("is `gleam peer` running?"), "{stderr}");
}
