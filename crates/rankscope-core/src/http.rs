//! Just enough HTTP/1.1 for one request per connection.
//!
//! The probe speaks HTTP so that `curl --unix-socket` works for anyone poking
//! at it by hand, but it only ever needs `Content-Length` bodies and
//! `Connection: close`, and, for a reply too big to hold whole in the target
//! (`python.tensors`), a response body that the closing of the connection
//! ends. `httparse` does the parsing; this module adds the size
//! limits that keep a misbehaving client from costing the target memory.

use std::io::{self, Read, Write};

use thiserror::Error;

/// Largest request head (request line plus headers) a probe accepts.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Largest request body a probe accepts (eval source, breakpoint specs).
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
const MAX_HEADERS: usize = 32;

#[derive(Debug, Error)]
pub enum HttpError {
    #[error("connection closed before a full message arrived")]
    Truncated,
    #[error("message head is larger than {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("message body of {0} bytes is larger than the {1}-byte limit")]
    BodyTooLarge(usize, usize),
    #[error("malformed HTTP message: {0}")]
    Malformed(String),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl HttpError {
    /// The status a server answers with when reading a request failed this way.
    pub fn status(&self) -> u16 {
        match self {
            HttpError::HeadTooLarge => 431,
            HttpError::BodyTooLarge(..) => 413,
            _ => 400,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// Path without the query string.
    pub path: String,
    /// Raw query string (after `?`), empty when absent.
    pub query: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        header_value(&self.headers, name)
    }

    /// Value of `key` in the query string; `key` alone counts as `"1"`.
    pub fn query_param(&self, key: &str) -> Option<&str> {
        self.query.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, "1"));
            (k == key).then_some(v)
        })
    }

    pub fn query_flag(&self, key: &str) -> bool {
        matches!(self.query_param(key), Some("1" | "true" | "yes"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

impl Response {
    pub fn json(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Response {
            status,
            content_type: "application/json",
            body: body.into(),
        }
    }

    /// An error answer: `{"error": message}` with the given status.
    pub fn error(status: u16, message: &str) -> Self {
        let body = serde_json::json!({ "error": message }).to_string();
        Response::json(status, body)
    }
}

fn header_value<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

/// One `read`, retried when a signal interrupted it: a socket with a read
/// timeout returns EINTR even under `SA_RESTART` (the REPL catches SIGINT).
fn read_some(stream: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match stream.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Reads bytes until the blank line that ends a message head. Returns the
/// head length and everything read so far (which may include body bytes).
fn read_head(stream: &mut impl Read) -> Result<(usize, Vec<u8>), HttpError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let n = read_some(stream, &mut chunk)?;
        if n == 0 {
            return Err(HttpError::Truncated);
        }
        let search_from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(pos) = buf[search_from..].windows(4).position(|w| w == b"\r\n\r\n") {
            let head_len = search_from + pos + 4;
            if head_len > MAX_HEAD_BYTES {
                return Err(HttpError::HeadTooLarge);
            }
            return Ok((head_len, buf));
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(HttpError::HeadTooLarge);
        }
    }
}

fn read_body(
    stream: &mut impl Read,
    mut already: Vec<u8>,
    length: usize,
    limit: usize,
) -> Result<Vec<u8>, HttpError> {
    if length > limit {
        return Err(HttpError::BodyTooLarge(length, limit));
    }
    if already.len() > length {
        already.truncate(length);
    }
    let start = already.len();
    already.resize(length, 0);
    let mut filled = start;
    while filled < length {
        let n = read_some(stream, &mut already[filled..])?;
        if n == 0 {
            return Err(HttpError::Truncated);
        }
        filled += n;
    }
    Ok(already)
}

/// A body without a length: what comes until the peer closes.
fn read_body_to_end(
    stream: &mut impl Read,
    mut body: Vec<u8>,
    limit: usize,
) -> Result<Vec<u8>, HttpError> {
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        if body.len() > limit {
            return Err(HttpError::BodyTooLarge(body.len(), limit));
        }
        let n = read_some(stream, &mut chunk)?;
        if n == 0 {
            return Ok(body);
        }
        body.extend_from_slice(&chunk[..n]);
    }
}

fn content_length(headers: &[(String, String)]) -> Result<usize, HttpError> {
    match header_value(headers, "content-length") {
        None => Ok(0),
        Some(v) => v
            .trim()
            .parse()
            .map_err(|_| HttpError::Malformed(format!("bad Content-Length {v:?}"))),
    }
}

fn collect_headers(raw: &[httparse::Header<'_>]) -> Vec<(String, String)> {
    raw.iter()
        .map(|h| {
            (
                h.name.to_string(),
                String::from_utf8_lossy(h.value).into_owned(),
            )
        })
        .collect()
}

/// Reads one request, enforcing the head and body limits.
pub fn read_request(stream: &mut impl Read, body_limit: usize) -> Result<Request, HttpError> {
    let (head_len, buf) = read_head(stream)?;
    let mut raw_headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut raw_headers);
    match parsed.parse(&buf[..head_len]) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(HttpError::Truncated),
        Err(e) => return Err(HttpError::Malformed(e.to_string())),
    }
    let method = parsed.method.unwrap_or_default().to_string();
    let target = parsed.path.unwrap_or("/");
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let headers = collect_headers(parsed.headers);
    let length = content_length(&headers)?;
    let body = read_body(stream, buf[head_len..].to_vec(), length, body_limit)?;
    Ok(Request {
        method,
        path: path.to_string(),
        query: query.to_string(),
        headers,
        body,
    })
}

pub fn write_response(stream: &mut (impl Write + ?Sized), response: &Response) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        response.status,
        reason(response.status),
        response.content_type,
        response.body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(&response.body)?;
    stream.flush()
}

/// The head of a 200 response whose body is written as it is made, and
/// ended by closing the connection.
pub fn write_streamed_head(
    stream: &mut (impl Write + ?Sized),
    content_type: &str,
) -> io::Result<()> {
    let head =
        format!("HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes())
}

/// Writes a request; `extra_headers` carries e.g. the TCP token.
pub fn write_request(
    stream: &mut impl Write,
    method: &str,
    path: &str,
    extra_headers: &[(&str, &str)],
    body: &[u8],
) -> io::Result<()> {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: rankscope\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in extra_headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    stream.flush()
}

/// Reads a whole response; a client trusts its probe more than a probe trusts
/// its clients, but still bounds the body (stacks with locals can be large).
pub fn read_response(stream: &mut impl Read, body_limit: usize) -> Result<Response, HttpError> {
    let (head_len, buf) = read_head(stream)?;
    let mut raw_headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut raw_headers);
    match parsed.parse(&buf[..head_len]) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(HttpError::Truncated),
        Err(e) => return Err(HttpError::Malformed(e.to_string())),
    }
    let status = parsed.code.unwrap_or(500);
    let headers = collect_headers(parsed.headers);
    let body = if header_value(&headers, "content-length").is_none() {
        read_body_to_end(stream, buf[head_len..].to_vec(), body_limit)?
    } else {
        let length = content_length(&headers)?;
        read_body(stream, buf[head_len..].to_vec(), length, body_limit)?
    };
    Ok(Response {
        status,
        content_type: "application/json",
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hands out a few bytes at a time, with an EINTR before each read.
    struct Interrupting<'a> {
        data: &'a [u8],
        interrupt_next: bool,
    }

    impl Read for Interrupting<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.interrupt_next = !self.interrupt_next;
            if !self.interrupt_next {
                return Err(io::Error::from(io::ErrorKind::Interrupted));
            }
            let n = buf.len().min(self.data.len()).min(7);
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    #[test]
    fn a_read_interrupted_by_a_signal_is_retried() {
        let mut wire = Vec::new();
        write_response(
            &mut wire,
            &Response::json(200, b"{\"interrupted\": true}".to_vec()),
        )
        .unwrap();
        let mut stream = Interrupting {
            data: &wire,
            interrupt_next: true,
        };
        let response = read_response(&mut stream, 1024).unwrap();
        assert_eq!(
            (response.status, response.body.as_slice()),
            (200, b"{\"interrupted\": true}".as_slice())
        );
    }

    #[test]
    fn request_round_trip_keeps_path_query_and_body() {
        let mut wire = Vec::new();
        write_request(
            &mut wire,
            "POST",
            "/v1/eval?x=1&locals",
            &[("Authorization", "Bearer t")],
            b"{}",
        )
        .unwrap();
        let req = read_request(&mut wire.as_slice(), MAX_BODY_BYTES).unwrap();
        assert_eq!(req.method, "POST");
        assert_eq!(req.path, "/v1/eval");
        assert_eq!(req.query_param("x"), Some("1"));
        assert!(req.query_flag("locals"));
        assert_eq!(req.header("authorization"), Some("Bearer t"));
        assert_eq!(req.body, b"{}");
    }

    #[test]
    fn oversized_body_is_refused_before_it_is_read() {
        let wire = b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n";
        let err = read_request(&mut wire.as_slice(), 1024).unwrap_err();
        assert_eq!(err.status(), 413);
    }

    #[test]
    fn oversized_head_is_refused() {
        let mut wire = b"GET / HTTP/1.1\r\n".to_vec();
        wire.extend(std::iter::repeat_n(b'a', MAX_HEAD_BYTES + 10));
        let err = read_request(&mut wire.as_slice(), 1024).unwrap_err();
        assert_eq!(err.status(), 431);
    }

    #[test]
    fn garbage_is_malformed_not_a_panic() {
        let wire = b"\x00\x01\x02 nonsense\r\n\r\n";
        let err = read_request(&mut wire.as_slice(), 1024).unwrap_err();
        assert_eq!(err.status(), 400);
    }

    #[test]
    fn truncated_body_is_reported() {
        let wire = b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc";
        assert!(matches!(
            read_request(&mut wire.as_slice(), 1024),
            Err(HttpError::Truncated)
        ));
    }

    #[test]
    fn response_round_trip() {
        let mut wire = Vec::new();
        write_response(&mut wire, &Response::error(404, "nope")).unwrap();
        let resp = read_response(&mut wire.as_slice(), 1024).unwrap();
        assert_eq!(resp.status, 404);
        assert_eq!(resp.body, br#"{"error":"nope"}"#);
    }

    #[test]
    fn streamed_response_ends_with_the_connection() {
        let mut wire = Vec::new();
        write_streamed_head(&mut wire, "application/json").unwrap();
        wire.extend_from_slice(b"[1,2,");
        wire.extend_from_slice(b"3]");
        let resp = read_response(&mut wire.as_slice(), 1024).unwrap();
        assert_eq!(resp.status, 200);
        assert_eq!(resp.body, b"[1,2,3]");
        let err = read_response(&mut wire.as_slice(), 4).unwrap_err();
        assert!(matches!(err, HttpError::BodyTooLarge(..)));
    }
}
