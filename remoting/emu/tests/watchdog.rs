//! The kernel watchdog and the stopping of kernels: a kernel that never ends leaves the sticky
//! `CUDA_ERROR_LAUNCH_TIMEOUT`; the end of the session, or a fault elsewhere, stops running kernels.

mod common;

use std::time::{Duration, Instant};

use common::{Emu, Params};
use gleam_emu::EmuConfig;
use gleam_protocol::registry::Handles;
use gleam_protocol::types::CUresult;
use gleam_server::backend::Backend;

/// `spin` loops until the word at its argument is non-zero (nobody sets it); `fault` stores to address 8.
const PTX: &str = r#"
.version 8.0
.target sm_75
.address_size 64

.visible .entry spin(.param .u64 p_flag)
{
	.reg .pred %p<2>;
	.reg .b32 %r<2>;
	.reg .b64 %rd<3>;
	ld.param.u64 %rd1, [p_flag];
	cvta.to.global.u64 %rd2, %rd1;
AGAIN:
	ld.volatile.global.u32 %r1, [%rd2];
	setp.eq.u32 %p1, %r1, 0;
	@%p1 bra AGAIN;
	ret;
}

.visible .entry fault()
{
	.reg .b32 %r<2>;
	.reg .b64 %rd<2>;
	mov.u64 %rd1, 8;
	mov.u32 %r1, 1;
	st.global.u32 [%rd1], %r1;
	ret;
}
"#;

fn emu(timeout: Option<Duration>) -> (Emu, u64, u64, u64) {
    let mut emu = Emu::with_config(EmuConfig {
        kernel_timeout: timeout,
        ..EmuConfig::with_memory(16 << 20)
    });
    let module = emu.load(PTX).unwrap();
    let spin = emu.function(module, "spin").unwrap().0;
    let fault = emu.function(module, "fault").unwrap().0;
    let flag = emu.alloc(4).unwrap();
    (emu, spin, fault, flag)
}

#[test]
fn a_kernel_past_the_watchdog_leaves_a_sticky_launch_timeout() {
    let (mut emu, spin, _, flag) = emu(Some(Duration::from_millis(300)));
    let (_, _, devices) = emu.b.describe().unwrap();
    assert_eq!(devices[0].attributes[17], 1, "KERNEL_EXEC_TIMEOUT");
    let started = Instant::now();
    emu.launch(spin, 2, 64, 0, &Params::default().u64(flag))
        .unwrap();
    assert_eq!(emu.sync(0), Err(CUresult::LAUNCH_TIMEOUT));
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    // Sticky: every later call reports it, and nothing more runs.
    assert_eq!(emu.alloc(16), Err(CUresult::LAUNCH_TIMEOUT));
    assert_eq!(
        emu.download_u32(flag, 1, None),
        Err(CUresult::LAUNCH_TIMEOUT)
    );
}

#[test]
fn the_end_of_the_session_stops_running_and_queued_kernels() {
    let (mut emu, spin, _, flag) = emu(None);
    let (_, _, devices) = emu.b.describe().unwrap();
    assert_eq!(devices[0].attributes[17], 0, "no watchdog");
    let a = emu.stream(1);
    let b = emu.stream(1);
    for stream in [a, a, b] {
        emu.launch(spin, 1, 32, stream, &Params::default().u64(flag))
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(emu.query(a), Err(CUresult::NOT_READY));
    let started = Instant::now();
    emu.b.shutdown(&Handles::default());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_fault_stops_the_kernels_still_running() {
    let (mut emu, spin, fault, flag) = emu(None);
    let spinning = emu.stream(1);
    emu.launch(spin, 1, 32, spinning, &Params::default().u64(flag))
        .unwrap();
    let other = emu.stream(1);
    emu.launch(fault, 1, 1, other, &Params::default()).unwrap();
    let started = Instant::now();
    // The spinning kernel is stopped: its stream drains, and reports the fault.
    assert_eq!(emu.sync(spinning), Err(CUresult::ILLEGAL_ADDRESS));
    assert!(started.elapsed() < Duration::from_secs(10));
}
