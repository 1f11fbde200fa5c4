//! Dialling a peer that has several addresses, happy-eyeballs style (RFC 8305's idea, for QUIC).
//!
//! A peer is often known by several addresses: IPv4 and IPv6, global and link-local, one per interface.
//! Some of them may not work from here (another subnet, a link-local address on the wrong interface, a
//! firewall that drops UDP). [`dial`] starts a handshake with the first address, and with the next one
//! whenever an attempt fails or [`Pace::stagger`] passes without an answer; the first handshake to
//! complete wins and every other attempt is abandoned. The caller learns which address answered
//! ([`Dialed::addr`]) so it can try that one first next time.
//!
//! Used by the mesh daemon (mesh links), by `gleam run` (the reachability check) and by the CUDA client
//! (the session connection): one implementation, one behaviour.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tracing::debug;

use crate::identity::PeerId;
use crate::target::display_addr;
use crate::tls::server_name;

/// How attempts are spaced and bounded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pace {
    /// Start the next address after this long without an answer (RFC 8305 suggests 250 ms on the
    /// Internet; a LAN answers in a few ms).
    pub stagger: Duration,
    /// Give up on one address after this long.
    pub attempt_timeout: Duration,
}

impl Default for Pace {
    fn default() -> Self {
        Self {
            stagger: Duration::from_millis(150),
            attempt_timeout: Duration::from_secs(3),
        }
    }
}

/// A completed handshake.
#[derive(Debug)]
pub struct Dialed {
    /// The connection (TLS done, the peer's key checked by `config`; the mesh proof is the caller's).
    pub conn: quinn::Connection,
    /// The address that answered first.
    pub addr: SocketAddr,
    /// How long it took from the first attempt.
    pub elapsed: Duration,
}

/// Dials `peer` at `addrs` (in order of preference) and returns the first completed handshake.
///
/// `config` must pin `peer` (see [`crate::tls::client_config`]). Attempts on addresses of a family the
/// endpoint cannot use fail at once and cost no time.
pub async fn dial(
    endpoint: &quinn::Endpoint,
    config: &quinn::ClientConfig,
    peer: PeerId,
    addrs: &[SocketAddr],
    pace: Pace,
) -> Result<Dialed, DialError> {
    let started = Instant::now();
    let mut failures: Vec<(SocketAddr, String)> = Vec::new();
    let mut attempts: JoinSet<(SocketAddr, Result<quinn::Connection, String>)> = JoinSet::new();
    let mut next = addrs.iter().copied();
    let mut more = true;
    let name = server_name(peer);
    loop {
        // Start the next address: at once when nothing is in flight, else after the stagger.
        if more && attempts.is_empty() {
            match next.next() {
                Some(addr) => start(&mut attempts, endpoint, config, &name, addr, pace),
                None => more = false,
            }
        }
        if attempts.is_empty() {
            return Err(DialError {
                peer,
                failures,
                no_address: addrs.is_empty(),
            });
        }
        let stagger = tokio::time::sleep(pace.stagger);
        tokio::select! {
            joined = attempts.join_next() => {
                let Some(joined) = joined else { continue };
                let (addr, result) = match joined {
                    Ok(done) => done,
                    // An attempt task cannot panic on its own; treat a cancelled one as failed.
                    Err(err) => {
                        debug!(%peer, error = %crate::Chain(&err), "dial attempt ended abnormally");
                        continue;
                    }
                };
                match result {
                    Ok(conn) => {
                        // Dropping the set aborts the other attempts (their connections close).
                        attempts.abort_all();
                        let elapsed = started.elapsed();
                        debug!(%peer, addr = %display_addr(&addr), ?elapsed, "dialled");
                        return Ok(Dialed { conn, addr, elapsed });
                    }
                    Err(why) => {
                        debug!(%peer, addr = %display_addr(&addr), %why, "dial attempt failed");
                        failures.push((addr, why));
                    }
                }
            }
            () = stagger, if more => {
                match next.next() {
                    Some(addr) => start(&mut attempts, endpoint, config, &name, addr, pace),
                    None => more = false,
                }
            }
        }
    }
}

fn start(
    attempts: &mut JoinSet<(SocketAddr, Result<quinn::Connection, String>)>,
    endpoint: &quinn::Endpoint,
    config: &quinn::ClientConfig,
    name: &str,
    addr: SocketAddr,
    pace: Pace,
) {
    let connecting = endpoint.connect_with(config.clone(), addr, name);
    attempts.spawn(async move {
        let result = match connecting {
            Err(err) => Err(err.to_string()),
            Ok(connecting) => match tokio::time::timeout(pace.attempt_timeout, connecting).await {
                Ok(Ok(conn)) => Ok(conn),
                Ok(Err(err)) => Err(err.to_string()),
                Err(_) => Err(format!("no answer within {:?}", pace.attempt_timeout)),
            },
        };
        (addr, result)
    });
}

/// A client endpoint that can dial both IPv4 and IPv6 (a dual-stack `[::]:0` socket), or IPv4 only
/// on a host without IPv6. Must be called inside a tokio runtime.
pub fn client_endpoint() -> std::io::Result<quinn::Endpoint> {
    crate::tls::endpoint(SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, 0)), None)
        .or_else(|_| crate::tls::endpoint(SocketAddr::from(([0, 0, 0, 0], 0)), None))
}

/// No address of a peer completed a handshake.
#[derive(Debug, Clone, thiserror::Error)]
pub struct DialError {
    /// The peer.
    pub peer: PeerId,
    /// Each address tried, and why it failed.
    pub failures: Vec<(SocketAddr, String)>,
    /// There was no address to try at all.
    pub no_address: bool,
}

impl DialError {
    /// Why each address failed, without naming the peer: `why` for one address, `tried N addresses:
    /// A (why); B (why)` for several.
    pub fn reasons(&self) -> String {
        match self.failures.as_slice() {
            [] => "no address to try".to_owned(),
            [(_, why)] => why.clone(),
            failures => {
                let each: Vec<String> = failures
                    .iter()
                    .map(|(addr, why)| format!("{} ({why})", display_addr(addr)))
                    .collect();
                format!("tried {} addresses: {}", failures.len(), each.join("; "))
            }
        }
    }
}

impl std::fmt::Display for DialError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.no_address {
            return write!(f, "no address known for peer {}", self.peer);
        }
        match self.failures.as_slice() {
            [(addr, why)] => write!(
                f,
                "cannot reach peer {} at {}: {why}",
                self.peer,
                display_addr(addr)
            ),
            failures => {
                write!(
                    f,
                    "cannot reach peer {} at any of its {} addresses:",
                    self.peer,
                    failures.len()
                )?;
                for (i, (addr, why)) in failures.iter().enumerate() {
                    let sep = if i == 0 { " " } else { "; " };
                    write!(f, "{sep}{} ({why})", display_addr(addr))?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Identity;
    use crate::tls::{ALPN_MESH, client_config, server_config};

    /// A server endpoint on loopback that accepts connections (and keeps them) until dropped.
    fn server(id: &Identity) -> (quinn::Endpoint, tokio::task::JoinHandle<()>) {
        let endpoint = crate::tls::endpoint(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            Some(server_config(id).unwrap()),
        )
        .unwrap();
        let accepting = endpoint.clone();
        let task = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Some(incoming) = accepting.accept().await {
                if let Ok(conn) = incoming.await {
                    kept.push(conn);
                }
            }
        });
        (endpoint, task)
    }

    /// A UDP socket that swallows everything: handshakes to it never complete.
    fn black_hole() -> (std::net::UdpSocket, SocketAddr) {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = socket.local_addr().unwrap();
        (socket, addr)
    }

    #[tokio::test]
    async fn a_silent_first_address_costs_one_stagger_and_the_answering_one_wins() {
        let (server_id, client_id) = (
            Identity::ephemeral().unwrap(),
            Identity::ephemeral().unwrap(),
        );
        let (server, _task) = server(&server_id);
        let live = server.local_addr().unwrap();
        let (_hole, dead) = black_hole();
        let client = client_endpoint().unwrap();
        let config = client_config(&client_id, server_id.peer_id(), ALPN_MESH).unwrap();
        let pace = Pace {
            stagger: Duration::from_millis(200),
            attempt_timeout: Duration::from_secs(3),
        };
        let dialed = dial(&client, &config, server_id.peer_id(), &[dead, live], pace)
            .await
            .unwrap();
        assert_eq!(dialed.addr, live);
        assert!(
            dialed.elapsed >= pace.stagger && dialed.elapsed < Duration::from_secs(2),
            "{:?}",
            dialed.elapsed
        );
        // The live address first: no waiting at all.
        let dialed = dial(&client, &config, server_id.peer_id(), &[live, dead], pace)
            .await
            .unwrap();
        assert_eq!(dialed.addr, live);
        assert!(dialed.elapsed < pace.stagger, "{:?}", dialed.elapsed);
    }

    #[tokio::test]
    async fn every_failure_is_reported_with_its_address() {
        let client_id = Identity::ephemeral().unwrap();
        let (server_id, wrong_id) = (
            Identity::ephemeral().unwrap(),
            Identity::ephemeral().unwrap(),
        );
        let (server, _task) = server(&server_id);
        let live = server.local_addr().unwrap();
        let (_hole, dead) = black_hole();
        let client = client_endpoint().unwrap();
        // Pinned to another key: the live server fails the TLS check, the silent one times out.
        let config = client_config(&client_id, wrong_id.peer_id(), ALPN_MESH).unwrap();
        let pace = Pace {
            stagger: Duration::from_millis(50),
            attempt_timeout: Duration::from_millis(400),
        };
        let err = dial(&client, &config, wrong_id.peer_id(), &[live, dead], pace)
            .await
            .unwrap_err();
        assert_eq!(err.failures.len(), 2, "{err}");
        let text = err.to_string();
        assert!(
            text.contains(&live.to_string()) && text.contains(&dead.to_string()),
            "{text}"
        );
        assert!(text.contains("no answer within"), "{text}");

        let none = dial(&client, &config, wrong_id.peer_id(), &[], pace)
            .await
            .unwrap_err();
        assert!(none.no_address);
        assert!(none.to_string().contains("no address known"), "{none}");
    }
}
