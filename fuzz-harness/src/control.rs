//! Target `control`: a request on the daemon's control socket (`gleam peers list`, `gleam run`'s choice
//! of peer; any local user in the socket's group can send one).
//!
//! The input is what a client writes. As the daemon does, the request is the first line (read through a
//! [`MAX_LINE`] limit; invalid UTF-8 gets no answer), decoded as JSON and answered from a small mesh of
//! sample peers: the member list, or the best peer for the job the request describes. Whatever the
//! request, the answer must be one line of JSON within [`MAX_LINE`] that the client side decodes.

use std::time::Duration;

use gleam_auth::identity::PeerId;
use gleam_mesh::control::{BestPeer, MAX_LINE, PeerRow, Request, Response};
use gleam_mesh::select::{self, Candidate};
use gleam_mesh::state::CacheDigest;

/// Runs one input. Panics only on a bug.
pub fn run(data: &[u8]) {
    let limit = usize::try_from(MAX_LINE).unwrap_or(usize::MAX);
    let limited = &data[..data.len().min(limit)];
    let line = match limited.iter().position(|&b| b == b'\n') {
        Some(end) => &limited[..=end],
        None => limited,
    };
    // `read_line` fails on invalid UTF-8: the daemon drops the connection without an answer.
    let Ok(line) = std::str::from_utf8(line) else {
        return;
    };
    let response = match serde_json::from_str::<Request>(line) {
        Ok(Request::List) => Response::Peers {
            peers: sample_rows(),
        },
        Ok(Request::Best { hint }) => {
            let candidates = sample_candidates();
            let best = select::choose(&candidates, &hint).map(|choice| BestPeer {
                id: choice.id,
                addrs: vec![std::net::SocketAddr::from(([127, 0, 0, 1], 4747))],
                expected_secs: choice.expected.as_secs_f64(),
                host: "sample".into(),
                rtt_us: Some(500),
                bandwidth_bps: None,
                emulated: false,
                is_self: false,
                loss: 0.01,
            });
            Response::Best { best }
        }
        Ok(_) => Response::Error {
            message: "unsupported request".into(),
        },
        Err(err) => Response::Error {
            message: format!("bad request: {err}"),
        },
    };
    check_reaches_client(&response);
}

/// Asserts that the daemon can send `response` and the client can read it (one line of JSON within
/// [`MAX_LINE`], decoded by `gleam_mesh::control::request`'s parser).
pub fn check_reaches_client(response: &Response) {
    let mut out = serde_json::to_vec(response).expect("the daemon's answer encodes as JSON");
    out.push(b'\n');
    assert!(
        out.len() as u64 <= MAX_LINE,
        "a {} byte answer is over the client's line limit",
        out.len()
    );
    assert_eq!(
        out.iter().filter(|&&b| b == b'\n').count(),
        1,
        "the answer is one line"
    );
    if let Err(err) = serde_json::from_slice::<Response>(&out) {
        panic!(
            "the client cannot read the daemon's answer ({err}): {}",
            String::from_utf8_lossy(&out)
        );
    }
}

fn sample_id(i: u8) -> PeerId {
    PeerId::from_bytes([0x10 + i; 16])
}

/// Three peers: a real GPU far away, a busy one nearby, an emulated one.
fn sample_candidates() -> Vec<Candidate> {
    (0..3u8)
        .map(|i| Candidate {
            id: sample_id(i),
            has_gpu: true,
            emulated: i == 2,
            rtt: Some(Duration::from_micros(200 + 5000 * u64::from(i == 0))),
            bandwidth_bps: (i != 1).then_some(1_000_000_000),
            loss: 0.01 * f64::from(i),
            utilization: 0.5 * f64::from(i),
            free_memory: 8 << 30,
            queue_len: u32::from(i),
            mean_job_secs: 2.0,
        })
        .collect()
}

fn sample_rows() -> Vec<PeerRow> {
    (0..3u8)
        .map(|i| PeerRow {
            id: sample_id(i),
            is_self: i == 0,
            host: format!("host-{i}"),
            gpus: Vec::new(),
            free_memory: 8 << 30,
            total_memory: 16 << 30,
            utilization: 0.25,
            active_sessions: 1,
            queue_len: 0,
            rtt_us: Some(300),
            bandwidth_bps: Some(1_000_000_000),
            loss: 0.0,
            cache: CacheDigest::default(),
            addrs: vec![std::net::SocketAddr::from(([10, 0, 0, i], 4747))],
            warnings: Vec::new(),
        })
        .collect()
}
