//! Where a peer can be reached: [`PeerAddr`], the one parser of `<peer-id>@HOST[:PORT][,HOST[:PORT]...]`.
//!
//! Every place that names a peer by address (`gleam run --peer`, `gleam peer --seed`, `gleam peers ping`,
//! the `GLEAM_PEER` variable read by the shim) goes through [`PeerAddr`]'s `FromStr`, so they accept the
//! same text: a peer id, `@`, then one or more comma-separated addresses. An address is an IPv4 or IPv6
//! literal (IPv6 in brackets when a port follows) or a host name, with an optional port ([`DEFAULT_PORT`]
//! when left out). Host names resolve to every address they have. An IPv6 link-local address needs the
//! interface it is reachable on: `[fe80::1%eth0]:4747` or `[fe80::1%2]:4747`; one given without it is
//! tried on every interface that has an IPv6 link-local address (see [`with_scopes`]).
//!
//! [`PeerAddr`]'s `Display` writes the machine form (`%` and the interface index), which parses back to
//! the same addresses; [`display_addr`] writes the human form (`%` and the interface name).

use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6, ToSocketAddrs};
use std::str::FromStr;

use crate::identity::PeerId;

/// The default UDP port of `gleam peer` (and of an address given without a port).
pub const DEFAULT_PORT: u16 = 4747;

/// A peer and the addresses it may be reached at, in the order to try them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerAddr {
    /// The peer (its TLS key must hash to this).
    pub id: PeerId,
    /// Its addresses, none repeated; link-local IPv6 ones carry their interface.
    pub addrs: Vec<SocketAddr>,
}

impl PeerAddr {
    /// A peer at these addresses (repeats dropped, order kept).
    pub fn new(id: PeerId, addrs: impl IntoIterator<Item = SocketAddr>) -> Self {
        let mut unique = Vec::new();
        for addr in addrs {
            if !unique.contains(&addr) {
                unique.push(addr);
            }
        }
        Self { id, addrs: unique }
    }

    /// Moves `addr` to the front (the address that answered last time is tried first next time).
    pub fn prefer(&mut self, addr: SocketAddr) {
        self.addrs.retain(|known| *known != addr);
        self.addrs.insert(0, addr);
    }
}

impl FromStr for PeerAddr {
    type Err = TargetError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.trim();
        let (id, hosts) = text.split_once('@').ok_or_else(|| TargetError::MissingAt {
            text: text.to_owned(),
        })?;
        let id: PeerId = id.trim().parse().map_err(|_| TargetError::BadPeerId {
            text: id.trim().to_owned(),
        })?;
        let mut addrs = Vec::new();
        for host in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
            addrs.extend(resolve(host)?);
        }
        if addrs.is_empty() {
            return Err(TargetError::NoAddress {
                text: text.to_owned(),
            });
        }
        Ok(Self::new(id, addrs))
    }
}

impl fmt::Display for PeerAddr {
    /// `<id>@addr,addr,...` with interface indices: parses back to the same addresses on this host.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@", self.id)?;
        for (i, addr) in self.addrs.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{addr}")?;
        }
        Ok(())
    }
}

/// Resolves one `HOST[:PORT]` item to all of its socket addresses.
pub fn resolve(item: &str) -> Result<Vec<SocketAddr>, TargetError> {
    let (host, port) = split_port(item)?;
    // A literal IP, possibly with `%scope`.
    if let Some(addr) = literal(host, port)? {
        return Ok(with_scopes(addr));
    }
    if host.is_empty() || host.contains(['[', ']', '%', '/', ' ']) {
        return Err(TargetError::BadAddress {
            text: item.to_owned(),
        });
    }
    let resolved: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|error| TargetError::Resolve {
            host: host.to_owned(),
            error: error.to_string(),
        })?
        .flat_map(with_scopes)
        .collect();
    if resolved.is_empty() {
        return Err(TargetError::NoAddress {
            text: host.to_owned(),
        });
    }
    Ok(resolved)
}

/// `addr`, or when it is an IPv6 link-local address without an interface, one copy per interface of
/// this host that has an IPv6 link-local address (which of them reaches the peer is for the dialer
/// to find out). Other addresses are returned as they are.
pub fn with_scopes(addr: SocketAddr) -> Vec<SocketAddr> {
    match addr {
        SocketAddr::V6(v6) if needs_scope(v6.ip()) && v6.scope_id() == 0 => link_local_interfaces()
            .into_iter()
            .map(|index| SocketAddr::V6(SocketAddrV6::new(*v6.ip(), v6.port(), 0, index)))
            .collect(),
        other => vec![other],
    }
}

/// Whether an IPv6 address is only meaningful together with an interface (link-local `fe80::/10`).
pub fn needs_scope(ip: &Ipv6Addr) -> bool {
    ip.segments()[0] & 0xffc0 == 0xfe80
}

/// An address as people read it: link-local IPv6 with the interface name (`[fe80::1%eth0]:4747`),
/// IPv4-mapped IPv6 as IPv4.
pub fn display_addr(addr: &SocketAddr) -> String {
    match addr {
        SocketAddr::V6(v6) if v6.scope_id() != 0 => match interface_name(v6.scope_id()) {
            Some(name) => format!("[{}%{name}]:{}", v6.ip(), v6.port()),
            None => addr.to_string(),
        },
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::from((v4, v6.port())).to_string(),
            None => addr.to_string(),
        },
        SocketAddr::V4(_) => addr.to_string(),
    }
}

/// The name of the interface with this index (`if_indextoname`).
pub fn interface_name(index: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has the IF_NAMESIZE bytes if_indextoname may write; it returns null or `buf`.
    let name = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if name.is_null() {
        return None;
    }
    // SAFETY: on success `buf` holds a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Some(name.to_string_lossy().into_owned())
}

/// The index of the interface with this name (`if_nametoindex`), or of this number.
pub fn interface_index(name: &str) -> Option<u32> {
    if let Ok(index) = name.parse::<u32>() {
        return (index > 0).then_some(index);
    }
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: a NUL-terminated string that lives across the call.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
}

/// Indices of the interfaces that are up and have an IPv6 link-local address.
pub fn link_local_interfaces() -> Vec<u32> {
    let Ok(interfaces) = if_addrs::get_if_addrs() else {
        return Vec::new();
    };
    let mut indices: Vec<u32> = interfaces
        .iter()
        .filter(|iface| !iface.is_loopback())
        .filter_map(|iface| match iface.ip() {
            IpAddr::V6(ip) if needs_scope(&ip) => iface.index,
            _ => None,
        })
        .collect();
    indices.sort_unstable();
    indices.dedup();
    indices
}

/// Splits `HOST[:PORT]`, `[V6][:PORT]` or a bare IPv6 literal into host and port.
fn split_port(item: &str) -> Result<(&str, u16), TargetError> {
    let bad = || TargetError::BadAddress {
        text: item.to_owned(),
    };
    let port = |text: &str| {
        text.parse::<u16>()
            .ok()
            .filter(|port| *port > 0)
            .ok_or_else(bad)
    };
    if let Some(rest) = item.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(bad)?;
        return match after {
            "" => Ok((host, DEFAULT_PORT)),
            _ => Ok((host, port(after.strip_prefix(':').ok_or_else(bad)?)?)),
        };
    }
    match item.matches(':').count() {
        0 => Ok((item, DEFAULT_PORT)),
        1 => {
            let (host, text) = item.split_once(':').ok_or_else(bad)?;
            Ok((host, port(text)?))
        }
        // Several colons and no brackets: a bare IPv6 address, no port.
        _ => Ok((item, DEFAULT_PORT)),
    }
}

/// A literal IPv4/IPv6 address (IPv6 optionally with `%interface`), or `None` for a host name.
fn literal(host: &str, port: u16) -> Result<Option<SocketAddr>, TargetError> {
    let (ip, scope) = match host.split_once('%') {
        Some((ip, scope)) => (ip, Some(scope)),
        None => (host, None),
    };
    let Ok(ip) = ip.parse::<IpAddr>() else {
        return Ok(None);
    };
    match (ip, scope) {
        (IpAddr::V4(v4), None) => Ok(Some(SocketAddr::from((v4, port)))),
        (IpAddr::V6(v6), None) => match v6.to_ipv4_mapped() {
            Some(v4) => Ok(Some(SocketAddr::from((v4, port)))),
            None => Ok(Some(SocketAddr::V6(SocketAddrV6::new(v6, port, 0, 0)))),
        },
        (IpAddr::V6(v6), Some(scope)) => {
            let index = interface_index(scope).ok_or_else(|| TargetError::UnknownInterface {
                name: scope.to_owned(),
            })?;
            Ok(Some(SocketAddr::V6(SocketAddrV6::new(v6, port, 0, index))))
        }
        (IpAddr::V4(_), Some(_)) => Err(TargetError::BadAddress {
            text: host.to_owned(),
        }),
    }
}

/// A target did not parse or resolve.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum TargetError {
    /// No `@` between the peer id and the address.
    #[error("{text:?} is not <peer-id>@HOST:PORT")]
    MissingAt { text: String },
    /// The part before `@` is not a peer id.
    #[error("{text:?} is not a peer id (26 base32 characters, as `gleam mesh show` prints)")]
    BadPeerId { text: String },
    /// An address item is malformed (a bad port, unbalanced brackets, a scope on IPv4...).
    #[error("{text:?} is not HOST, HOST:PORT, [IPV6]:PORT or [IPV6%INTERFACE]:PORT")]
    BadAddress { text: String },
    /// A host name did not resolve.
    #[error("cannot resolve {host:?}: {error}")]
    Resolve { host: String, error: String },
    /// A host name (or the whole target) yields no address.
    #[error("{text:?} names no address")]
    NoAddress { text: String },
    /// `%NAME` names no interface of this host.
    #[error(
        "no network interface {name:?} on this host (for a link-local address, `ip link` lists them)"
    )]
    UnknownInterface { name: String },
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, SocketAddrV4};

    use super::*;

    fn id() -> PeerId {
        PeerId::from_bytes([7; 16])
    }

    #[test]
    fn one_address_with_and_without_port() {
        let target: PeerAddr = format!("{}@10.0.0.2:7443", id()).parse().unwrap();
        assert_eq!(target.id, id());
        assert_eq!(target.addrs, vec![SocketAddr::from(([10, 0, 0, 2], 7443))]);
        let target: PeerAddr = format!(" {}@10.0.0.2 ", id()).parse().unwrap();
        assert_eq!(
            target.addrs,
            vec![SocketAddr::from(([10, 0, 0, 2], DEFAULT_PORT))]
        );
        let target: PeerAddr = format!("{}@[2001:db8::1]:9", id()).parse().unwrap();
        assert_eq!(
            target.addrs,
            vec!["[2001:db8::1]:9".parse::<SocketAddr>().unwrap()]
        );
        let target: PeerAddr = format!("{}@2001:db8::1", id()).parse().unwrap();
        assert_eq!(target.addrs[0].port(), DEFAULT_PORT);
        // IPv4-mapped IPv6 is IPv4.
        let target: PeerAddr = format!("{}@[::ffff:10.0.0.3]:5", id()).parse().unwrap();
        assert_eq!(target.addrs, vec![SocketAddr::from(([10, 0, 0, 3], 5))]);
    }

    #[test]
    fn several_addresses_keep_their_order_without_repeats() {
        let text = format!("{}@10.0.0.2:1, [2001:db8::1]:2,10.0.0.2:1,10.0.0.9:3", id());
        let target: PeerAddr = text.parse().unwrap();
        assert_eq!(
            target.addrs,
            vec![
                SocketAddr::from(([10, 0, 0, 2], 1)),
                "[2001:db8::1]:2".parse().unwrap(),
                SocketAddr::from(([10, 0, 0, 9], 3)),
            ]
        );
        // Display is the machine form and parses back to the same target.
        assert_eq!(target.to_string().parse::<PeerAddr>().unwrap(), target);
        let mut preferred = target.clone();
        preferred.prefer(SocketAddr::from(([10, 0, 0, 9], 3)));
        assert_eq!(preferred.addrs[0], SocketAddr::from(([10, 0, 0, 9], 3)));
        assert_eq!(preferred.addrs.len(), 3);
    }

    #[test]
    fn host_names_resolve_to_every_address() {
        let target: PeerAddr = format!("{}@localhost:4000", id()).parse().unwrap();
        assert!(!target.addrs.is_empty());
        assert!(
            target
                .addrs
                .iter()
                .all(|addr| addr.ip().is_loopback() && addr.port() == 4000),
            "{target:?}"
        );
        let err = format!("{}@no-such-host.invalid:1", id())
            .parse::<PeerAddr>()
            .unwrap_err();
        assert!(matches!(err, TargetError::Resolve { .. }), "{err}");
    }

    #[test]
    fn link_local_addresses_carry_their_interface() {
        // Loopback always exists; its name and index work as a scope.
        let lo = interface_index("lo").expect("loopback interface");
        for scope in ["lo".to_owned(), lo.to_string()] {
            let target: PeerAddr = format!("{}@[fe80::1%{scope}]:4747", id()).parse().unwrap();
            assert_eq!(
                target.addrs,
                vec![SocketAddr::V6(SocketAddrV6::new(
                    "fe80::1".parse().unwrap(),
                    4747,
                    0,
                    lo
                ))]
            );
            // The machine form keeps the index, so GLEAM_PEER round-trips.
            assert_eq!(target.to_string().parse::<PeerAddr>().unwrap(), target);
            assert_eq!(display_addr(&target.addrs[0]), "[fe80::1%lo]:4747");
        }
        let err = format!("{}@[fe80::1%nosuchif0]:4747", id())
            .parse::<PeerAddr>()
            .unwrap_err();
        assert!(matches!(err, TargetError::UnknownInterface { .. }), "{err}");
        // Without a scope: one candidate per interface with a link-local address (maybe none
        // here), never a scope-less one that could not be dialled.
        let bare = with_scopes("[fe80::1]:4747".parse().unwrap());
        assert!(bare.iter().all(|addr| match addr {
            SocketAddr::V6(v6) => v6.scope_id() != 0,
            SocketAddr::V4(_) => false,
        }));
        // Global addresses are left alone.
        let global: SocketAddr = "[2001:db8::1]:1".parse().unwrap();
        assert_eq!(with_scopes(global), vec![global]);
    }

    #[test]
    fn malformed_targets_say_what_is_wrong() {
        let cases = [
            ("10.0.0.2:4747".to_owned(), "MissingAt"),
            ("nothex@10.0.0.2:4747".to_owned(), "BadPeerId"),
            (format!("{}@", id()), "NoAddress"),
            (format!("{}@10.0.0.2:0", id()), "BadAddress"),
            (format!("{}@10.0.0.2:99999", id()), "BadAddress"),
            (format!("{}@[2001:db8::1", id()), "BadAddress"),
            (format!("{}@[2001:db8::1]x", id()), "BadAddress"),
            (format!("{}@10.0.0.2%eth0:1", id()), "BadAddress"),
        ];
        for (text, kind) in cases {
            let err = text.parse::<PeerAddr>().unwrap_err();
            assert!(format!("{err:?}").starts_with(kind), "{text}: {err:?}");
        }
    }

    #[test]
    fn mapped_addresses_display_as_ipv4() {
        let mapped = SocketAddr::V6(SocketAddrV6::new(
            Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped(),
            4747,
            0,
            0,
        ));
        assert_eq!(display_addr(&mapped), "10.0.0.1:4747");
        let v4 = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 1));
        assert_eq!(display_addr(&v4), "10.0.0.1:1");
    }
}
