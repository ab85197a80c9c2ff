//! Where the target's shared objects are loaded, and where their exported
//! symbols are at run time: `/proc/PID/maps` plus each file's dynamic symbol
//! table (read by goblin, not by hand).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use goblin::elf::program_header::PT_LOAD;
use goblin::elf::Elf;

use crate::InjectError;

/// One file mapped into the target, with the address its ELF vaddr 0 sits at.
#[derive(Debug, Clone)]
pub struct Module {
    pub path: PathBuf,
    /// The lowest mapping of the file at offset 0.
    map_start: u64,
}

pub fn modules(pid: u32) -> Result<Vec<Module>, InjectError> {
    let text =
        std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => InjectError::NoProcess(pid),
            _ => InjectError::Io {
                what: format!("/proc/{pid}/maps"),
                source: e,
            },
        })?;
    let mut starts: HashMap<PathBuf, u64> = HashMap::new();
    let mut order = Vec::new();
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(_perms), Some(offset), Some(_dev), Some(_inode)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            continue;
        };
        let path: String = fields.collect::<Vec<_>>().join(" ");
        if !path.starts_with('/') || path.ends_with(" (deleted)") {
            continue;
        }
        let (Some(start), Ok(0)) = (
            range
                .split('-')
                .next()
                .and_then(|s| u64::from_str_radix(s, 16).ok()),
            u64::from_str_radix(offset, 16),
        ) else {
            continue;
        };
        let path = PathBuf::from(path);
        if !starts.contains_key(&path) {
            order.push(path.clone());
        }
        let entry = starts.entry(path).or_insert(start);
        *entry = (*entry).min(start);
    }
    Ok(order
        .into_iter()
        .map(|path| Module {
            map_start: starts[&path],
            path,
        })
        .collect())
}

impl Module {
    pub fn file_name(&self) -> &str {
        self.path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
    }

    /// Run-time addresses of the named dynamic symbols (those found).
    pub fn symbols(&self, pid: u32, names: &[&str]) -> Result<HashMap<String, u64>, InjectError> {
        // Through the target's root, so a process in another mount namespace
        // (a container) is read from its own files.
        let in_root = Path::new(&format!("/proc/{pid}/root"))
            .join(self.path.strip_prefix("/").unwrap_or(&self.path));
        let bytes = std::fs::read(&in_root)
            .or_else(|_| std::fs::read(&self.path))
            .map_err(|e| InjectError::Io {
                what: self.path.display().to_string(),
                source: e,
            })?;
        let elf = Elf::parse(&bytes).map_err(|e| InjectError::Elf {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        let page = 4096u64;
        let first_load = elf
            .program_headers
            .iter()
            .filter(|h| h.p_type == PT_LOAD)
            .map(|h| h.p_vaddr & !(page - 1))
            .min()
            .unwrap_or(0);
        let base = self.map_start.wrapping_sub(first_load);
        let mut found = HashMap::new();
        for sym in elf.dynsyms.iter() {
            if sym.st_value == 0 || sym.st_shndx == 0 {
                continue; // an import, not a definition
            }
            if let Some(name) = elf.dynstrtab.get_at(sym.st_name) {
                // Versioned duplicates (dlopen@GLIBC_2.2.5 and @2.34) share a
                // name here; any definition is callable.
                if names.contains(&name) && !found.contains_key(name) {
                    found.insert(name.to_string(), base.wrapping_add(sym.st_value));
                }
            }
        }
        Ok(found)
    }
}

/// The C library: glibc's `libc.so.6` (dlopen lives there since 2.34), or
/// musl's `ld-musl-*.so.1`.
pub fn libc(modules: &[Module]) -> Option<&Module> {
    modules.iter().find(|m| {
        let name = m.file_name();
        name.starts_with("libc.so") || name.starts_with("libc-2.") || name.starts_with("ld-musl-")
    })
}

/// glibc before 2.34 keeps dlopen in libdl.
pub fn libdl(modules: &[Module]) -> Option<&Module> {
    modules
        .iter()
        .find(|m| m.file_name().starts_with("libdl.so") || m.file_name().starts_with("libdl-2."))
}

/// The file mapped at `address` in the target, if any.
pub fn file_at(pid: u32, address: u64) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    text.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (start, end) = fields.next()?.split_once('-')?;
        let (start, end) = (
            u64::from_str_radix(start, 16).ok()?,
            u64::from_str_radix(end, 16).ok()?,
        );
        if !(start..end).contains(&address) {
            return None;
        }
        let path: String = fields.skip(4).collect::<Vec<_>>().join(" ");
        path.starts_with('/').then(|| PathBuf::from(path))
    })
}
