//! `pathMappings`: the editor's paths (local) against the target's (remote).
//!
//! The adapter runs beside the target (it reaches the probe over a unix
//! socket), so remote paths are POSIX paths on this machine. The editor may
//! run elsewhere, Windows included: a local root that looks like a Windows
//! path (`c:\src`, or any backslash) is compared without regard to case and
//! its tails are joined with backslashes.

use std::path::{Component, Path, PathBuf};

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
struct Mapping {
    local: String,
    remote: String,
    windows: bool,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct PathMap {
    mappings: Vec<Mapping>,
}

fn looks_windows(path: &str) -> bool {
    let b = path.as_bytes();
    path.contains('\\') || (b.len() >= 2 && b[0].is_ascii_alphabetic() && b[1] == b':')
}

/// Drops trailing separators, but keeps a root (`/`, `c:\`) whole.
fn trim_root(root: &str, windows: bool) -> String {
    let seps: &[char] = if windows { &['\\', '/'] } else { &['/'] };
    let trimmed = root.trim_end_matches(seps);
    if trimmed.is_empty() || (windows && trimmed.len() == 2 && trimmed.ends_with(':')) {
        return root.to_string();
    }
    trimmed.to_string()
}

/// `.` and `..` taken out without touching the file system (a remote root
/// need not exist when the mapping is made).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// The rest of `path` after `root` when `root` is a whole-component prefix.
fn tail<'p>(path: &'p str, root: &str, windows: bool) -> Option<&'p str> {
    let head = path.get(..root.len())?;
    let same = if windows {
        head.replace('/', "\\")
            .eq_ignore_ascii_case(&root.replace('/', "\\"))
    } else {
        head == root
    };
    if !same {
        return None;
    }
    let rest = &path[root.len()..];
    let root_ends_in_sep = root.ends_with('/') || (windows && root.ends_with('\\'));
    if rest.is_empty() || root_ends_in_sep {
        return Some(rest);
    }
    let sep = rest.as_bytes()[0];
    (sep == b'/' || (windows && sep == b'\\')).then(|| &rest[1..])
}

fn join(root: &str, rest: &str, windows: bool) -> String {
    if rest.is_empty() {
        return root.to_string();
    }
    let sep = if windows { '\\' } else { '/' };
    let rest: String = if windows {
        rest.replace('/', "\\")
    } else {
        rest.replace('\\', "/")
    };
    if root.ends_with(sep) || (!windows && root.ends_with('/')) {
        format!("{root}{rest}")
    } else {
        format!("{root}{sep}{rest}")
    }
}

impl PathMap {
    /// From the attach request's `pathMappings` (`[{localRoot, remoteRoot}]`).
    /// A relative remote root (VSCode's template has `"."`) is taken from
    /// the target's working directory, as debugpy does.
    pub fn from_json(mappings: Option<&Value>, remote_cwd: Option<&Path>) -> Result<Self, String> {
        let Some(mappings) = mappings.filter(|v| !v.is_null()) else {
            return Ok(PathMap::default());
        };
        let list = mappings
            .as_array()
            .ok_or("pathMappings must be a list of {\"localRoot\", \"remoteRoot\"}")?;
        let mut out = Vec::new();
        for entry in list {
            let field = |name: &str| {
                entry
                    .get(name)
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or_else(|| format!("a pathMappings entry has no {name} string: {entry}"))
            };
            let (local, remote) = (field("localRoot")?, field("remoteRoot")?);
            out.push((local, remote));
        }
        Ok(PathMap::new(out, remote_cwd))
    }

    pub fn new(pairs: Vec<(String, String)>, remote_cwd: Option<&Path>) -> Self {
        let mappings: Vec<Mapping> = pairs
            .into_iter()
            .filter(|(l, r)| !l.is_empty() && !r.is_empty())
            .map(|(local, remote)| {
                let windows = looks_windows(&local);
                let remote_path = Path::new(&remote);
                let remote = match remote_cwd {
                    Some(cwd) if remote_path.is_relative() => {
                        normalize(&cwd.join(remote_path)).display().to_string()
                    }
                    _ => remote,
                };
                Mapping {
                    local: trim_root(&local, windows),
                    remote: trim_root(&remote, false),
                    windows,
                }
            })
            .collect();
        PathMap { mappings }
    }

    pub fn is_empty(&self) -> bool {
        self.mappings.is_empty()
    }

    /// An editor's path as the target knows it.
    pub fn to_remote(&self, local: &str) -> String {
        let best = self
            .mappings
            .iter()
            .filter_map(|m| Some((m, tail(local, &m.local, m.windows)?)))
            .max_by_key(|(m, _)| m.local.len());
        match best {
            Some((m, rest)) => join(&m.remote, rest, false),
            None => local.to_string(),
        }
    }

    /// A target's path as the editor knows it.
    pub fn to_local(&self, remote: &str) -> String {
        let best = self
            .mappings
            .iter()
            .filter_map(|m| Some((m, tail(remote, &m.remote, false)?)))
            .max_by_key(|(m, _)| m.remote.len());
        match best {
            Some((m, rest)) => join(&m.local, rest, m.windows),
            None => remote.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(pairs: &[(&str, &str)]) -> PathMap {
        PathMap::new(
            pairs
                .iter()
                .map(|(l, r)| (l.to_string(), r.to_string()))
                .collect(),
            Some(Path::new("/srv/job")),
        )
    }

    #[test]
    fn both_ways_on_component_boundaries() {
        let m = map(&[("/home/me/proj", "/app")]);
        assert_eq!(m.to_remote("/home/me/proj/train.py"), "/app/train.py");
        assert_eq!(m.to_local("/app/train.py"), "/home/me/proj/train.py");
        assert_eq!(m.to_local("/app"), "/home/me/proj");
        // `/application` is not under `/app`.
        assert_eq!(m.to_local("/application/x.py"), "/application/x.py");
        assert_eq!(
            m.to_remote("/home/me/project/x.py"),
            "/home/me/project/x.py"
        );
        // Unmapped paths pass through.
        assert_eq!(
            m.to_local("/usr/lib/python3.11/os.py"),
            "/usr/lib/python3.11/os.py"
        );
    }

    #[test]
    fn trailing_separators_and_the_longest_root() {
        let m = map(&[
            ("/home/me/proj/", "/app/"),
            ("/home/me/proj/lib", "/opt/lib"),
        ]);
        assert_eq!(m.to_remote("/home/me/proj/lib/a.py"), "/opt/lib/a.py");
        assert_eq!(m.to_remote("/home/me/proj/b.py"), "/app/b.py");
        assert_eq!(m.to_local("/opt/lib/a.py"), "/home/me/proj/lib/a.py");
        let root = map(&[("/", "/")]);
        assert_eq!(root.to_local("/x/y.py"), "/x/y.py");
    }

    #[test]
    fn a_relative_remote_root_is_the_targets_working_directory() {
        // VSCode's "Remote Attach" template: {"localRoot": "${workspaceFolder}", "remoteRoot": "."}.
        let m = PathMap::from_json(
            Some(&json!([{"localRoot": "/home/me/proj", "remoteRoot": "."}])),
            Some(Path::new("/srv/job")),
        )
        .unwrap();
        assert_eq!(m.to_remote("/home/me/proj/train.py"), "/srv/job/train.py");
        assert_eq!(
            m.to_local("/srv/job/sub/model.py"),
            "/home/me/proj/sub/model.py"
        );
        let up = map(&[("/l", "../other")]);
        assert_eq!(up.to_remote("/l/a.py"), "/srv/other/a.py");
    }

    #[test]
    fn a_windows_editor() {
        let m = map(&[(r"c:\Users\me\proj", "/app")]);
        assert_eq!(
            m.to_remote(r"C:\Users\me\proj\pkg\train.py"),
            "/app/pkg/train.py"
        );
        assert_eq!(
            m.to_remote("c:/Users/me/proj/pkg/train.py"),
            "/app/pkg/train.py"
        );
        assert_eq!(
            m.to_local("/app/pkg/train.py"),
            r"c:\Users\me\proj\pkg\train.py"
        );
    }

    #[test]
    fn bad_mappings_are_refused_with_the_reason() {
        assert!(PathMap::from_json(Some(&json!({"localRoot": "/a"})), None).is_err());
        let err = PathMap::from_json(Some(&json!([{"localRoot": "/a"}])), None).unwrap_err();
        assert!(err.contains("remoteRoot"), "{err}");
        assert!(PathMap::from_json(None, None).unwrap().is_empty());
        assert!(PathMap::from_json(Some(&Value::Null), None)
            .unwrap()
            .is_empty());
    }
}
