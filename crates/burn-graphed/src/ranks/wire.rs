//! The messages between a rank's process and rank 0's (`super::process`), as frames: a
//! little-endian `u32` length, then the body. Hand-written, so that the vocabulary needs no
//! serialization crate, and a payload of `f32`s travels as its bytes.

use std::io::{self, Read, Write};
use std::sync::Arc;

use super::round::{Combine, Entry, Gathered};
use crate::error::GraphedError;

/// The first bytes of a rank's greeting: the protocol and its version.
const MAGIC: &[u8; 8] = b"BGRANKS1";

/// The largest frame read after the greeting.
const MAX_FRAME: usize = 1 << 31;

/// The most values one rank's statement or one outcome may carry: a frame's, less room for
/// the rest of the message (about half a billion `f32`s: a gradient bucket or a model's
/// values; a round combines the ranks' into one, [`Combine`]).
pub(crate) const MAX_VALUES: usize = (MAX_FRAME - (1 << 20)) / 4;

/// The largest greeting: a peer that is not a rank (a port scanner, another program on the
/// port) is refused before the hub allocates anything for it.
const MAX_HELLO: usize = 64;

/// A rank's message to rank 0's process.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToHub {
    /// The first message of a connection: which rank of a group of which size.
    Hello { rank: usize, size: usize },
    /// The rank's statement in the next round.
    Round(Entry),
    /// The rank cannot go on: every rank gets [`GraphedError::RankFailed`] naming it.
    Abandon { what: String, reason: String },
}

/// Rank 0's process to a rank's.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum FromHub {
    /// The greeting is accepted.
    Welcome,
    /// The greeting is refused (a wrong size, a rank taken twice), with the reason.
    Refused(String),
    /// The outcome of the round the rank stated in.
    Outcome(Result<Gathered, GraphedError>),
    /// The group ended outside a round (a rank's process gone, a rank's abandonment, a
    /// timeout): sent at once, whatever the rank is doing (`super::round::OnEnd`).
    Ended(GraphedError),
}

struct Body(Vec<u8>);

impl Body {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: usize) -> &mut Self {
        let v = u32::try_from(v).unwrap_or(u32::MAX);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn text(&mut self, v: &str) -> &mut Self {
        self.u32(v.len());
        self.0.extend_from_slice(v.as_bytes());
        self
    }
    fn floats(&mut self, v: &[f32]) -> &mut Self {
        self.u32(v.len());
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
        self
    }
}

struct Cursor<'a>(&'a [u8]);

fn invalid(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("a malformed frame: {what}"),
    )
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> io::Result<&[u8]> {
        if self.0.len() < n {
            return Err(invalid("it ends early"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> io::Result<usize> {
        let bytes: [u8; 4] = self.take(4)?.try_into().map_err(|_| invalid("u32"))?;
        Ok(u32::from_le_bytes(bytes) as usize)
    }
    fn u64(&mut self) -> io::Result<u64> {
        let bytes: [u8; 8] = self.take(8)?.try_into().map_err(|_| invalid("u64"))?;
        Ok(u64::from_le_bytes(bytes))
    }
    fn text(&mut self) -> io::Result<String> {
        let len = self.u32()?;
        String::from_utf8(self.take(len)?.to_vec()).map_err(|_| invalid("text"))
    }
    fn floats(&mut self) -> io::Result<Vec<f32>> {
        let len = self.u32()?;
        let bytes = self.take(len.checked_mul(4).ok_or_else(|| invalid("length"))?)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

fn entry(body: &mut Body, e: &Entry) {
    body.text(&e.what);
    match &e.decision {
        Ok(text) => body.u8(0).text(text),
        Err(text) => body.u8(1).text(text),
    };
    body.u8(u8::from(e.vote)).floats(&e.payload);
    body.u8(match e.combine {
        Combine::Gather => 0,
        Combine::Mean => 1,
        Combine::First => 2,
    });
}

fn read_entry(c: &mut Cursor<'_>) -> io::Result<Entry> {
    let what = c.text()?;
    let decision = match c.u8()? {
        0 => Ok(c.text()?),
        1 => Err(c.text()?),
        _ => return Err(invalid("decision")),
    };
    let vote = c.u8()? != 0;
    let payload = c.floats()?;
    let combine = match c.u8()? {
        0 => Combine::Gather,
        1 => Combine::Mean,
        2 => Combine::First,
        _ => return Err(invalid("combine")),
    };
    Ok(Entry {
        what,
        decision,
        vote,
        payload,
        combine,
    })
}

/// The errors a round ends with cross as themselves; any other (a rank 0 thread's own, through
/// [`super::RankGroup::abandon`]) as [`GraphedError::RankFailed`] of rank 0 with its text.
fn error(body: &mut Body, e: &GraphedError) {
    match e {
        GraphedError::RankFailed { rank, what, reason } => {
            body.u8(0).u32(*rank).text(what).text(reason);
        }
        GraphedError::RanksDisagree { what, decisions } => {
            body.u8(1).text(what).text(decisions);
        }
        GraphedError::RankTimeout {
            what,
            missing,
            waited_ms,
        } => {
            body.u8(2).text(what).u32(missing.len());
            for rank in missing {
                body.u32(*rank);
            }
            body.u64(*waited_ms);
        }
        other => {
            body.u8(0).u32(0).text("the group").text(&other.to_string());
        }
    }
}

fn read_error(c: &mut Cursor<'_>) -> io::Result<GraphedError> {
    Ok(match c.u8()? {
        0 => GraphedError::RankFailed {
            rank: c.u32()?,
            what: c.text()?,
            reason: c.text()?,
        },
        1 => GraphedError::RanksDisagree {
            what: c.text()?,
            decisions: c.text()?,
        },
        2 => {
            let what = c.text()?;
            let missing = (0..c.u32()?).map(|_| c.u32()).collect::<io::Result<_>>()?;
            GraphedError::RankTimeout {
                what,
                missing,
                waited_ms: c.u64()?,
            }
        }
        _ => return Err(invalid("error kind")),
    })
}

impl ToHub {
    fn encode(&self) -> Vec<u8> {
        let mut body = Body(Vec::new());
        match self {
            ToHub::Hello { rank, size } => {
                body.0.extend_from_slice(MAGIC);
                body.u8(0).u32(*rank).u32(*size);
            }
            ToHub::Round(e) => {
                body.u8(1);
                entry(&mut body, e);
            }
            ToHub::Abandon { what, reason } => {
                body.u8(2).text(what).text(reason);
            }
        }
        body.0
    }

    fn decode(bytes: &[u8]) -> io::Result<Self> {
        let mut c = Cursor(bytes);
        if bytes.starts_with(MAGIC) {
            c.take(MAGIC.len())?;
        }
        Ok(match c.u8()? {
            0 if bytes.starts_with(MAGIC) => ToHub::Hello {
                rank: c.u32()?,
                size: c.u32()?,
            },
            1 => ToHub::Round(read_entry(&mut c)?),
            2 => ToHub::Abandon {
                what: c.text()?,
                reason: c.text()?,
            },
            _ => return Err(invalid("not a rank's message")),
        })
    }
}

impl FromHub {
    fn encode(&self) -> Vec<u8> {
        let mut body = Body(Vec::new());
        match self {
            FromHub::Welcome => {
                body.u8(0);
            }
            FromHub::Refused(reason) => {
                body.u8(1).text(reason);
            }
            FromHub::Outcome(Ok(gathered)) => {
                body.u8(2)
                    .u8(u8::from(gathered.any))
                    .u32(gathered.payloads.len());
                for payload in gathered.payloads.iter() {
                    body.floats(payload);
                }
            }
            FromHub::Outcome(Err(e)) => {
                body.u8(3);
                error(&mut body, e);
            }
            FromHub::Ended(e) => {
                body.u8(4);
                error(&mut body, e);
            }
        }
        body.0
    }

    fn decode(bytes: &[u8]) -> io::Result<Self> {
        let mut c = Cursor(bytes);
        Ok(match c.u8()? {
            0 => FromHub::Welcome,
            1 => FromHub::Refused(c.text()?),
            2 => {
                let any = c.u8()? != 0;
                let payloads = (0..c.u32()?)
                    .map(|_| c.floats())
                    .collect::<io::Result<Vec<_>>>()?;
                FromHub::Outcome(Ok(Gathered {
                    any,
                    payloads: Arc::new(payloads),
                }))
            }
            3 => FromHub::Outcome(Err(read_error(&mut c)?)),
            4 => FromHub::Ended(read_error(&mut c)?),
            _ => return Err(invalid("not rank 0's message")),
        })
    }
}

fn write_frame(out: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| invalid("a frame over 4 GiB"))?;
    out.write_all(&len.to_le_bytes())?;
    out.write_all(body)?;
    out.flush()
}

fn read_frame(input: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    input.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(invalid("a frame over the limit"));
    }
    let mut body = vec![0u8; len];
    input.read_exact(&mut body)?;
    Ok(body)
}

pub(crate) fn send_to_hub(out: &mut impl Write, message: &ToHub) -> io::Result<()> {
    write_frame(out, &message.encode())
}

pub(crate) fn read_to_hub(input: &mut impl Read) -> io::Result<ToHub> {
    ToHub::decode(&read_frame(input, MAX_FRAME)?)
}

/// A connection's first message, which must be a greeting.
pub(crate) fn read_hello(input: &mut impl Read) -> io::Result<(usize, usize)> {
    match ToHub::decode(&read_frame(input, MAX_HELLO)?)? {
        ToHub::Hello { rank, size } => Ok((rank, size)),
        _ => Err(invalid("no greeting")),
    }
}

pub(crate) fn send_from_hub(out: &mut impl Write, message: &FromHub) -> io::Result<()> {
    write_frame(out, &message.encode())
}

pub(crate) fn read_from_hub(input: &mut impl Read) -> io::Result<FromHub> {
    FromHub::decode(&read_frame(input, MAX_FRAME)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip_to_hub(message: ToHub) {
        let mut bytes = Vec::new();
        send_to_hub(&mut bytes, &message).expect("write");
        assert_eq!(read_to_hub(&mut bytes.as_slice()).expect("read"), message);
    }

    fn round_trip_from_hub(message: FromHub) {
        let mut bytes = Vec::new();
        send_from_hub(&mut bytes, &message).expect("write");
        assert_eq!(read_from_hub(&mut bytes.as_slice()).expect("read"), message);
    }

    #[test]
    fn every_message_reads_back_as_written() {
        round_trip_to_hub(ToHub::Hello { rank: 3, size: 4 });
        round_trip_to_hub(ToHub::Round(Entry {
            what: "the bucket".into(),
            decision: Ok("(3, 120, 77)".into()),
            vote: true,
            payload: vec![1.5, -0.0, f32::MIN_POSITIVE, 3e38],
            combine: Combine::Mean,
        }));
        round_trip_to_hub(ToHub::Round(Entry {
            what: "a capture".into(),
            decision: Err("out of memory".into()),
            vote: false,
            payload: Vec::new(),
            combine: Combine::First,
        }));
        round_trip_to_hub(ToHub::Abandon {
            what: "its training".into(),
            reason: "it panicked".into(),
        });
        round_trip_from_hub(FromHub::Welcome);
        round_trip_from_hub(FromHub::Refused("rank 1 joined twice".into()));
        round_trip_from_hub(FromHub::Outcome(Ok(Gathered {
            any: true,
            payloads: Arc::new(vec![vec![1.0, 2.0], vec![3.0, 4.0]]),
        })));
        for error in [
            GraphedError::RankFailed {
                rank: 2,
                what: "step".into(),
                reason: "boom".into(),
            },
            GraphedError::RanksDisagree {
                what: "step".into(),
                decisions: "rank 0: a; rank 1: b".into(),
            },
            GraphedError::RankTimeout {
                what: "all-reduce".into(),
                missing: vec![1, 3],
                waited_ms: 300,
            },
        ] {
            round_trip_from_hub(FromHub::Outcome(Err(error.clone())));
            round_trip_from_hub(FromHub::Ended(error));
        }
    }

    #[test]
    fn a_stranger_s_bytes_are_refused_not_trusted() {
        // An HTTP request on the rendezvous port: its first four bytes read as a huge length.
        let stranger = b"GET / HTTP/1.1\r\n\r\n".to_vec();
        assert!(read_hello(&mut stranger.as_slice()).is_err());
        // A frame of a greeting's size without the protocol's magic.
        let mut bytes = Vec::new();
        write_frame(&mut bytes, &[0, 1, 0, 0, 0, 2, 0, 0, 0]).expect("write");
        assert!(read_hello(&mut bytes.as_slice()).is_err());
        // A rank's greeting reads back.
        let mut bytes = Vec::new();
        send_to_hub(&mut bytes, &ToHub::Hello { rank: 1, size: 2 }).expect("write");
        assert_eq!(
            read_hello(&mut bytes.as_slice()).expect("a greeting"),
            (1, 2)
        );
    }
}
