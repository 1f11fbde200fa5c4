//! End to end, no GPU: less common driver calls real programs make (2D memsets, peer copies and peer
//! access on one device, the device by PCI bus id), as a C program (`tests/remote/driver_more.c`) sees them through `gleam run`
//! against `gleam serve --backend emu`. The same program runs on NVIDIA's driver (the ignored GPU test).

mod common;

use std::time::Duration;

use common::{Server, compile_c, output_within, text};

const LIMIT: Duration = Duration::from_secs(60);

fn run_on(server: &Server, exe: &std::path::Path, mode: &str) -> String {
    let out = output_within(server.run(exe, &[mode]), LIMIT);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "driver_more {mode}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains(&format!("{mode} ok")), "{stdout}");
    stdout
}

/// `cuMemsetD2D8/16/32` and their async forms fill exactly the rows' elements (the pitch's padding and
/// what follows stay as they were), a pitched allocation whole; misaligned fills and rows wider than
/// the pitch are refused. `cuMemcpyPeer`/`cuMemcpyPeerAsync` copy between two contexts of the device;
/// peer access answers as the driver does for one device (it is not its own peer).
/// `cuDeviceGetByPCIBusId` finds the device by its bus id, in full or short form.
#[test]
fn two_d_memsets_and_peer_copies() {
    let server = Server::start("emu");
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_more", dir.path());
    let stdout = run_on(&server, &exe, "memset2d");
    for line in [
        "2D memsets ok",
        "2D memsets on a stream ok",
        "2D memset of a pitched allocation ok",
        "bad 2D memsets refused ok",
    ] {
        assert!(stdout.contains(line), "{line}:\n{stdout}");
    }
    let stdout = run_on(&server, &exe, "peer");
    assert!(
        stdout.contains("peer copies between two contexts of one device ok"),
        "{stdout}"
    );
    assert!(stdout.contains("peer access on one device ok"), "{stdout}");
    let stdout = run_on(&server, &exe, "pci");
    assert!(stdout.contains("device by PCI bus id ok"), "{stdout}");
}

/// On a machine with a GPU: the same program on NVIDIA's driver directly and through Gleam on that GPU.
#[test]
#[ignore = "needs a GPU: driver_more on NVIDIA's driver and through gleam serve --backend cuda"]
fn the_same_program_passes_on_nvidias_driver_and_through_gleam_on_a_gpu() {
    let server = Server::start("cuda");
    let dir = tempfile::tempdir().unwrap();
    let exe = compile_c("driver_more", dir.path());
    for mode in ["memset2d", "peer", "pci"] {
        let native = output_within(
            {
                let mut cmd = std::process::Command::new(&exe);
                cmd.arg(mode).env_remove("LD_LIBRARY_PATH");
                cmd
            },
            LIMIT,
        );
        assert!(
            native.status.success(),
            "{mode} on NVIDIA's driver:\n{}{}",
            text(&native.stdout),
            text(&native.stderr)
        );
        run_on(&server, &exe, mode);
    }
}
