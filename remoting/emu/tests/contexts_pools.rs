//! Contexts, context-wide events and memory pools on the emu backend.

mod common;

use common::{Emu, PTX, Params};
use gleam_protocol::api::args;
use gleam_protocol::types::{CUexecAffinityParam, CUresult};
use gleam_server::backend::{ApiBackend, Backend};

#[test]
fn contexts_have_ids_and_refuse_affinity_the_device_does_not_offer() {
    let mut emu = Emu::new(16 << 20);
    let id = |emu: &mut Emu, ctx| {
        emu.b
            .cuCtxGetId(args::cuCtxGetId { ctx, id: () })
            .unwrap()
            .id
    };
    let ctx = emu.ctx;
    let primary = id(&mut emu, ctx);
    let created = emu
        .b
        .cuCtxCreate_v3(args::cuCtxCreate_v3 {
            pctx: (),
            params: Box::new(CUexecAffinityParam::default()),
            num_params: 0,
            flags: 0,
            dev: 0,
        })
        .unwrap()
        .pctx;
    let second = id(&mut emu, created);
    assert_ne!(primary, second);
    assert_eq!(id(&mut emu, 0), primary, "NULL: the current context");
    let supported = emu
        .b
        .cuDeviceGetExecAffinitySupport(args::cuDeviceGetExecAffinitySupport {
            pi: (),
            type_: 0,
            dev: 0,
        })
        .unwrap()
        .pi;
    assert_eq!(supported, 0);
    let limited = emu.b.cuCtxCreate_v3(args::cuCtxCreate_v3 {
        pctx: (),
        params: Box::new(CUexecAffinityParam { kind: 0, value: 1 }),
        num_params: 1,
        flags: 0,
        dev: 0,
    });
    assert_eq!(
        limited.map(|o| o.pctx),
        Err(CUresult::UNSUPPORTED_EXEC_AFFINITY)
    );
    let affinity = emu
        .b
        .cuCtxGetExecAffinity(args::cuCtxGetExecAffinity {
            affinity: (),
            type_: 0,
        })
        .unwrap()
        .affinity;
    assert_eq!(affinity.value as i32, gleam_emu::device::multiprocessors());
    emu.b
        .cuCtxSetSharedMemConfig(args::cuCtxSetSharedMemConfig { config: 2 })
        .unwrap();
    let config = emu
        .b
        .cuCtxGetSharedMemConfig(args::cuCtxGetSharedMemConfig { config: () })
        .unwrap()
        .config;
    assert_eq!(config, 2);
}

/// `cuCtxRecordEvent` captures the work of every stream of the context; `cuCtxWaitEvent` makes all later
/// work of the context wait for an event.
#[test]
fn context_events_capture_and_hold_the_whole_context() {
    let mut emu = Emu::new(16 << 20);
    let module = emu.load(PTX).unwrap();
    let slow_fill = emu.function(module, "slowFill").unwrap().0;
    let add_one = emu.function(module, "addOne").unwrap().0;
    let buf = emu.alloc(256 * 4).unwrap();
    let out = emu.alloc(256 * 4).unwrap();
    let (a, b) = (emu.stream(1), emu.stream(1));
    emu.launch(
        slow_fill,
        1,
        256,
        a,
        &Params::default().u64(buf).u32(7).u32(20_000),
    )
    .unwrap();
    let captured = emu.event(0);
    emu.b
        .cuCtxRecordEvent(args::cuCtxRecordEvent {
            ctx: 0,
            event: captured,
        })
        .unwrap();
    // Later work on another stream waits for it, through the context.
    emu.b
        .cuCtxWaitEvent(args::cuCtxWaitEvent {
            ctx: 0,
            event: captured,
        })
        .unwrap();
    emu.launch(add_one, 1, 256, b, &Params::default().u64(buf).u64(out))
        .unwrap();
    emu.sync(b).unwrap();
    assert_eq!(emu.download_u32(out, 256, None).unwrap(), vec![20_008; 256]);
}

#[test]
fn stream_ordered_frees_refuse_a_second_free_and_reuse_after_the_stream_got_there() {
    let mut emu = Emu::new(16 << 20);
    let s = emu.stream(1);
    let alloc = |emu: &mut Emu| {
        emu.b
            .cuMemAllocAsync(args::cuMemAllocAsync {
                dptr: (),
                bytesize: 4096,
                stream: s,
            })
            .unwrap()
            .dptr
    };
    let free = |emu: &mut Emu, dptr| {
        emu.b
            .cuMemFreeAsync(args::cuMemFreeAsync { dptr, stream: s })
            .map(|_| ())
    };
    let a = alloc(&mut emu);
    free(&mut emu, a).unwrap();
    assert_eq!(free(&mut emu, a), Err(CUresult::INVALID_VALUE));
    emu.sync(s).unwrap();
    // Threshold 0: synchronisation gave the memory back; a new allocation may land anywhere.
    let pool = emu
        .b
        .cuDeviceGetMemPool(args::cuDeviceGetMemPool { pool: (), dev: 0 })
        .unwrap()
        .pool;
    let attr = |emu: &mut Emu, attr| {
        emu.b
            .cuMemPoolGetAttribute(args::cuMemPoolGetAttribute {
                pool,
                attr,
                value: (),
            })
            .unwrap()
            .value
    };
    assert_eq!(attr(&mut emu, 5), 0);
    // With a threshold, freed memory is kept and handed out again.
    emu.b
        .cuMemPoolSetAttribute(args::cuMemPoolSetAttribute {
            pool,
            attr: 4,
            value: Box::new(1 << 20),
        })
        .unwrap();
    let b = alloc(&mut emu);
    free(&mut emu, b).unwrap();
    emu.sync(s).unwrap();
    assert_eq!(attr(&mut emu, 5), 4096);
    assert_eq!(alloc(&mut emu), b);
    // The default pool cannot be destroyed; a pool of a device that does not exist cannot be current.
    assert_eq!(
        emu.b
            .cuMemPoolDestroy(args::cuMemPoolDestroy { pool })
            .map(|_| ()),
        Err(CUresult::INVALID_VALUE)
    );
    assert_eq!(
        emu.b
            .cuDeviceSetMemPool(args::cuDeviceSetMemPool { dev: 1, pool })
            .map(|_| ()),
        Err(CUresult::INVALID_DEVICE)
    );
    emu.b
        .shutdown(&gleam_protocol::registry::Handles::default());
}
