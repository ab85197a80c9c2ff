//! DAP's base protocol: a `Content-Length` header block, a blank line, then
//! that many bytes of JSON.

use std::io::{self, BufRead, Write};

use serde_json::Value;
use thiserror::Error;

/// Large enough for any request an editor sends (a `setBreakpoints` for a
/// file with thousands of breakpoints is well under 1 MiB); a client that
/// announces more is broken or hostile, and the adapter would otherwise
/// allocate what it asks for.
pub const DEFAULT_MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// A header line longer than this is not DAP: stop before buffering it all.
const MAX_HEADER_LINE: usize = 1024;
/// Clients send one or two headers; many more means the stream is garbage.
const MAX_HEADERS: usize = 32;

#[derive(Debug, Error)]
pub enum FramingError {
    #[error("reading from the client: {0}")]
    Io(#[from] io::Error),
    #[error("the client closed the connection in the middle of a message")]
    Truncated,
    #[error("bad header line from the client: {0:?}")]
    BadHeader(String),
    #[error("a header line from the client is longer than {MAX_HEADER_LINE} bytes")]
    HeaderTooLong,
    #[error("more than {MAX_HEADERS} header lines from the client")]
    TooManyHeaders,
    #[error("a message from the client has no Content-Length header")]
    MissingLength,
    #[error("bad Content-Length from the client: {0:?}")]
    BadLength(String),
    #[error("a message of {length} bytes from the client is over the limit of {max} bytes")]
    TooLarge { length: usize, max: usize },
    #[error("a message from the client is not JSON: {0}")]
    BadJson(serde_json::Error),
}

impl FramingError {
    /// After these the stream is still in step: the next message can be read.
    pub fn recoverable(&self) -> bool {
        matches!(self, FramingError::BadJson(_))
    }
}

/// Reads framed messages from any buffered reader.
pub struct MessageReader<R> {
    inner: R,
    max: usize,
}

impl<R: BufRead> MessageReader<R> {
    pub fn new(inner: R, max: usize) -> Self {
        MessageReader { inner, max }
    }

    /// The next message; `None` at a clean end of stream (between messages).
    pub fn read(&mut self) -> Result<Option<Value>, FramingError> {
        let mut length = None;
        let mut headers = 0;
        loop {
            let Some(line) = self.read_line(headers == 0)? else {
                return Ok(None);
            };
            if line.is_empty() {
                // Some clients send a stray blank line between messages.
                if headers == 0 {
                    continue;
                }
                break;
            }
            headers += 1;
            if headers > MAX_HEADERS {
                return Err(FramingError::TooManyHeaders);
            }
            let (name, value) = line
                .split_once(':')
                .ok_or_else(|| FramingError::BadHeader(line.clone()))?;
            if name.trim().eq_ignore_ascii_case("content-length") {
                let value = value.trim();
                let n: usize = value
                    .parse()
                    .map_err(|_| FramingError::BadLength(value.to_string()))?;
                length = Some(n);
            }
        }
        let length = length.ok_or(FramingError::MissingLength)?;
        if length > self.max {
            return Err(FramingError::TooLarge {
                length,
                max: self.max,
            });
        }
        let mut body = vec![0; length];
        self.inner.read_exact(&mut body).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                FramingError::Truncated
            } else {
                FramingError::Io(e)
            }
        })?;
        serde_json::from_slice(&body)
            .map(Some)
            .map_err(FramingError::BadJson)
    }

    /// One header line without its line ending; `None` at end of stream when
    /// `at_start` (nothing of a message read yet).
    fn read_line(&mut self, at_start: bool) -> Result<Option<String>, FramingError> {
        let mut line = Vec::new();
        loop {
            let available = match self.inner.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            };
            if available.is_empty() {
                if at_start && line.is_empty() {
                    return Ok(None);
                }
                return Err(FramingError::Truncated);
            }
            let (taken, done) = match available.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (available.len(), false),
            };
            line.extend_from_slice(&available[..taken]);
            self.inner.consume(taken);
            if line.len() > MAX_HEADER_LINE + 2 {
                return Err(FramingError::HeaderTooLong);
            }
            if done {
                break;
            }
        }
        line.pop();
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        String::from_utf8(line)
            .map(Some)
            .map_err(|e| FramingError::BadHeader(String::from_utf8_lossy(e.as_bytes()).into()))
    }
}

/// Writes one message with its header, in one `write_all` so that a message
/// never interleaves with another writer's on the same stream.
pub fn write_message(out: &mut dyn Write, message: &Value) -> io::Result<()> {
    let body = serde_json::to_vec(message)?;
    let mut framed = format!("Content-Length: {}\r\n\r\n", body.len()).into_bytes();
    framed.extend_from_slice(&body);
    out.write_all(&framed)?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::io::{BufReader, Read};

    /// Hands out its bytes a few at a time, as a socket may.
    struct Trickle {
        data: Vec<u8>,
        at: usize,
        step: usize,
    }

    impl Read for Trickle {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = self.step.min(buf.len()).min(self.data.len() - self.at);
            buf[..n].copy_from_slice(&self.data[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    fn reader(data: &[u8], step: usize) -> MessageReader<BufReader<Trickle>> {
        let trickle = Trickle {
            data: data.to_vec(),
            at: 0,
            step,
        };
        // A tiny buffer makes header lines span several fills.
        MessageReader::new(BufReader::with_capacity(3, trickle), 1024)
    }

    fn framed(messages: &[Value]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in messages {
            write_message(&mut out, m).unwrap();
        }
        out
    }

    #[test]
    fn messages_split_across_reads_come_back_whole() {
        let messages = [
            json!({"seq": 1, "type": "request", "command": "initialize"}),
            json!({"seq": 2, "type": "request", "command": "attach", "arguments": {"x": "é"}}),
        ];
        let data = framed(&messages);
        for step in [1, 2, 7, 1000] {
            let mut r = reader(&data, step);
            assert_eq!(r.read().unwrap().as_ref(), Some(&messages[0]));
            assert_eq!(r.read().unwrap().as_ref(), Some(&messages[1]));
            assert!(r.read().unwrap().is_none(), "clean end of stream");
        }
    }

    #[test]
    fn other_headers_and_bare_newlines_are_accepted() {
        let data =
            b"Content-Type: application/vscode-jsonrpc; charset=utf-8\ncontent-length: 2\n\n{}";
        assert_eq!(reader(data, 5).read().unwrap(), Some(json!({})));
    }

    #[test]
    fn bad_headers_are_named() {
        type Check = fn(&FramingError) -> bool;
        let cases: [(&[u8], Check); 5] = [
            (b"Content-Length 5\r\n\r\n{}", |e| {
                matches!(e, FramingError::BadHeader(_))
            }),
            (b"Content-Length: five\r\n\r\n{}", |e| {
                matches!(e, FramingError::BadLength(_))
            }),
            (b"Content-Type: x\r\n\r\n{}", |e| {
                matches!(e, FramingError::MissingLength)
            }),
            (b"Content-Length: 10\r\n\r\n{}", |e| {
                matches!(e, FramingError::Truncated)
            }),
            (b"Content-Length: 2\r\n", |e| {
                matches!(e, FramingError::Truncated)
            }),
        ];
        for (data, expected) in cases {
            let err = reader(data, 3).read().unwrap_err();
            assert!(
                expected(&err),
                "{:?}: {err:?}",
                String::from_utf8_lossy(data)
            );
            assert!(!err.recoverable());
        }
        let long = format!("X-{}: y\r\n\r\n", "a".repeat(5000));
        assert!(matches!(
            reader(long.as_bytes(), 100).read(),
            Err(FramingError::HeaderTooLong)
        ));
    }

    #[test]
    fn an_oversize_message_is_refused_before_it_is_read() {
        let data = b"Content-Length: 999999999999\r\n\r\n";
        match reader(data, 100).read() {
            Err(FramingError::TooLarge { length, max }) => {
                assert_eq!((length, max), (999999999999, 1024));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_json_leaves_the_stream_in_step() {
        let mut data = b"Content-Length: 3\r\n\r\n{x}".to_vec();
        data.extend(framed(&[json!({"seq": 1})]));
        let mut r = reader(&data, 4);
        let err = r.read().unwrap_err();
        assert!(err.recoverable(), "{err}");
        assert_eq!(r.read().unwrap(), Some(json!({"seq": 1})));
    }
}
