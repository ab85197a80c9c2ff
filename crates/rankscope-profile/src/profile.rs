//! The fold: stacks interned once, counted per thread.

pub mod wire;

use rustc_hash::FxHashMap;

/// A Python (or native) frame as profiles show it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FrameKey {
    pub func: String,
    pub file: String,
    pub line: i64,
}

impl FrameKey {
    /// `func (file.py:12)`, the file's last path component only.
    pub fn label(&self, lines: bool) -> String {
        let short = self.file.rsplit('/').next().unwrap_or(&self.file);
        if lines && self.line > 0 {
            format!("{} ({short}:{})", self.func, self.line)
        } else if short.is_empty() {
            self.func.clone()
        } else {
            format!("{} ({short})", self.func)
        }
    }
}

/// A frame as a sampler reads it, borrowed: a sample whose stack was seen
/// before is counted without copying or allocating anything.
#[derive(Debug, Clone, Copy)]
pub struct FrameRef<'a> {
    pub func: &'a str,
    pub file: &'a str,
    pub line: i64,
}

impl FrameRef<'_> {
    #[inline]
    fn is(&self, key: &FrameKey) -> bool {
        self.line == key.line
            && same_bytes(self.func.as_bytes(), key.func.as_bytes())
            && same_bytes(self.file.as_bytes(), key.file.as_bytes())
    }

    fn of(key: &FrameKey) -> FrameRef<'_> {
        FrameRef {
            func: &key.func,
            file: &key.file,
            line: key.line,
        }
    }

    /// Where to look for this frame, never proof that it is there: the
    /// lengths, the line and the last 8 bytes of each name, where names
    /// differ most (a `forward` from another `forward` by its file, a file
    /// from another by its last component). Hashing every byte cost as much
    /// as the comparison that has to follow anyway.
    #[inline]
    fn sig(&self) -> u64 {
        let (func, file) = (self.func.as_bytes(), self.file.as_bytes());
        let shape = ((func.len() as u64) << 40) ^ ((file.len() as u64) << 20) ^ self.line as u64;
        (tail(func) ^ shape).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ (tail(file) ^ shape.rotate_left(32)).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
    }
}

/// The last 8 bytes of `s` (all of it if shorter) as one number; between
/// strings of one length under 8 bytes, equal numbers are equal strings.
#[inline]
fn tail(s: &[u8]) -> u64 {
    let n = s.len();
    if n >= 8 {
        word(s, n - 8)
    } else {
        s.iter().fold(0, |acc, &b| (acc << 8) | u64::from(b))
    }
}

#[inline]
fn word(s: &[u8], at: usize) -> u64 {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&s[at..at + 8]);
    u64::from_le_bytes(bytes)
}

#[inline]
fn chunk(s: &[u8], at: usize) -> u128 {
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&s[at..at + 16]);
    u128::from_le_bytes(bytes)
}

/// `a == b` for the short strings frames are made of, inlined and in
/// overlapping loads of 16 or 8 bytes: a call to `memcmp` for each name
/// was most of the comparison.
#[inline(always)]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n > 16 {
        if n > 32 {
            return a == b;
        }
        chunk(a, 0) == chunk(b, 0) && chunk(a, n - 16) == chunk(b, n - 16)
    } else if n >= 8 {
        word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8)
    } else {
        tail(a) == tail(b)
    }
}

/// The end of a chain of `frame_same_sig`.
const NONE: usize = usize::MAX;

/// A 64x64-bit product's two halves, xored: the mixing step of wyhash and
/// foldhash, one multiply for 16 bytes of input.
#[inline(always)]
fn fold_mul(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    (r as u64) ^ ((r >> 64) as u64)
}

const K0: u64 = 0x243f_6a88_85a3_08d3;
const K1: u64 = 0x1319_8a2e_0370_7344;
const K2: u64 = 0xa409_3822_299f_31d0;
const K3: u64 = 0x082e_fa98_ec4e_6c89;

/// Every byte of `s` folded into `h`, 16 bytes a multiply. Up to 16
/// bytes are read as two (overlapping) words, which with the length (in
/// `h` already, see `frame_hash`) say exactly which string it was; longer
/// ones 16 bytes at a time, the last block overlapping the one before.
#[inline(always)]
fn absorb(s: &[u8], mut h: u64, k: u64) -> u64 {
    let n = s.len();
    if n > 32 {
        let mut at = 0;
        while at + 16 < n {
            h = fold_mul(word(s, at) ^ k, word(s, at + 8) ^ h);
            at += 16;
        }
    } else if n > 16 {
        h = fold_mul(word(s, 0) ^ k, word(s, 8) ^ h);
    } else if n >= 8 {
        return fold_mul(word(s, 0) ^ k, word(s, n - 8) ^ h);
    } else if n >= 4 {
        return fold_mul(u64::from(half(s, 0)) ^ k, u64::from(half(s, n - 4)) ^ h);
    } else if n > 0 {
        let a = (u64::from(s[0]) << 16) | (u64::from(s[n / 2]) << 8) | u64::from(s[n - 1]);
        return fold_mul(a ^ k, h);
    } else {
        return fold_mul(k, h);
    }
    fold_mul(word(s, n - 16) ^ k, word(s, n - 8) ^ h)
}

#[inline]
fn half(s: &[u8], at: usize) -> u32 {
    let mut bytes = [0u8; 4];
    bytes.copy_from_slice(&s[at..at + 4]);
    u32::from_le_bytes(bytes)
}

/// A frame's names and line, every byte of them, folded into `h`: the
/// line and both lengths first (so that where one name ends and the next
/// begins counts), then each name's bytes.
#[inline(always)]
fn frame_hash(frame: &FrameRef<'_>, h: u64) -> u64 {
    let (func, file) = (frame.func.as_bytes(), frame.file.as_bytes());
    let shape = frame.line as u64 ^ ((func.len() as u64) << 32) ^ ((file.len() as u64) << 48);
    absorb(file, absorb(func, h ^ shape, K1), K2)
}

/// A stack's key: its frames folded in order, outermost first, into four
/// lanes (frame i into lane i mod 4) joined at the end with the depth.
/// One chain made each frame wait for the multiplies of the frame before;
/// with four, four frames' multiplies run at once. Two different samples'
/// keys meet with odds of about n^2 / 2^65 for n distinct keys (a stack on
/// a thread, idle or not: 3e-10 for 100 k), so a key found is taken without comparing the
/// sample's names with the stack's: that comparison, of every byte of
/// every frame (each sample's names are fresh strings from py-spy), was
/// most of the fold's time.
#[inline]
fn stack_hash(frames: &[FrameRef<'_>]) -> u64 {
    let (mut a, mut b, mut c, mut d) = (K0, K1, K2, K3);
    let mut quads = frames.chunks_exact(4);
    for q in &mut quads {
        a = frame_hash(&q[0], a);
        b = frame_hash(&q[1], b);
        c = frame_hash(&q[2], c);
        d = frame_hash(&q[3], d);
    }
    let rest = quads.remainder();
    if let Some(f) = rest.first() {
        a = frame_hash(f, a);
    }
    if let Some(f) = rest.get(1) {
        b = frame_hash(f, b);
    }
    if let Some(f) = rest.get(2) {
        c = frame_hash(f, c);
    }
    // Lanes no frame reached are still their seeds: joined with other
    // constants, so that none of them is 0 (0 times anything is 0).
    fold_mul(a ^ frames.len() as u64, b ^ K2) ^ fold_mul(c ^ K3, d ^ K0)
}

/// A sample's key: its stack's, told apart by thread, idle and GIL (a
/// multiply by an odd number is one-to-one, so no two of those meet).
const TALLY_MIX: u64 = 0xf39c_c060_5ced_c835;

#[inline]
fn tally_key(stack: u64, thread: usize, idle: bool, gil: bool) -> u64 {
    let tag = ((thread as u64) << 2) | (u64::from(idle) << 1) | u64::from(gil);
    stack ^ tag.wrapping_add(1).wrapping_mul(TALLY_MIX)
}

/// Keys that are already well mixed are their own hash.
#[derive(Default, Clone, Copy)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys come here; anything else is hashed plainly.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, key: u64) {
        self.0 = key;
    }
}

type KeyMap<V> = std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<KeyHasher>>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadInfo {
    pub id: u64,
    pub name: String,
}

/// Which thread, which stack, and how the thread was when sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackKey {
    pub thread: usize,
    pub stack: usize,
    pub idle: bool,
    pub gil: bool,
}

/// A run of consecutive samples of one thread with the same stack, in 24
/// bytes: at 40 a million of them (a profile whose every sample starts a
/// new run) were 40 MB, and their pages a tenth of the fold's time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slice {
    pub start_s: f64,
    pub end_s: f64,
    stack: u32,
    /// thread << 2 | idle << 1 | GIL
    tag: u32,
}

impl Slice {
    /// None past what a slice holds (4 G stacks, 1 G threads).
    pub fn new(key: StackKey, start_s: f64, end_s: f64) -> Option<Slice> {
        Some(Slice {
            start_s,
            end_s,
            stack: u32::try_from(key.stack).ok()?,
            tag: slice_tag(key.thread, key.idle, key.gil)?,
        })
    }

    pub fn key(&self) -> StackKey {
        StackKey {
            thread: (self.tag >> 2) as usize,
            stack: self.stack as usize,
            idle: self.tag & 2 != 0,
            gil: self.tag & 1 != 0,
        }
    }
}

#[inline]
fn slice_tag(thread: usize, idle: bool, gil: bool) -> Option<u32> {
    let thread = u32::try_from(thread).ok().filter(|&t| t < 1 << 30)?;
    Some((thread << 2) | (u32::from(idle) << 1) | u32::from(gil))
}

#[derive(Debug, Default, Clone)]
pub struct Profile {
    pub pid: u32,
    pub rank: Option<i64>,
    /// Interned frames; a stack holds their indices, outermost first.
    pub frames: Vec<FrameKey>,
    pub stacks: Vec<Vec<usize>>,
    pub threads: Vec<ThreadInfo>,
    /// Samples per (thread, stack, idle, GIL): those of `add` at once,
    /// those of `add_sample` once `finish` is called.
    pub counts: FxHashMap<StackKey, u64>,
    pub slices: Vec<Slice>,
    /// Samples taken (one per tick, all threads), ticks missed because a
    /// read took longer than the interval, reads that failed.
    pub ticks: u64,
    pub missed: u64,
    pub errors: u64,
    pub rate_hz: f64,
    pub started_at: f64,
    pub duration_s: f64,
    /// Samples by stack and torch step, for those taken while the target's
    /// probe knew the step (`set_step`); `counts` has every sample.
    pub steps: FxHashMap<(StackKey, i64), u64>,
    /// The steps as they went: (step, first seen, last seen + a tick), in
    /// seconds since the start; the Chrome trace draws them as a lane.
    pub step_spans: Vec<(i64, f64, f64)>,
    step: Option<i64>,
    /// Frames by signature, the first of each; `frame_same_sig[id]` is the
    /// next frame with id's signature. A borrowed frame is found without
    /// copying it, and a candidate is compared before it is taken.
    frame_by_sig: FxHashMap<u64, usize>,
    frame_same_sig: Vec<usize>,
    stack_ids: FxHashMap<Vec<usize>, usize>,
    /// Stacks met through `add_sample`, by key (`stack_hash`).
    by_key: KeyMap<usize>,
    /// `add_sample`'s counts until `finish` adds them to `counts`: the
    /// stack and count of each (thread, stack, idle, GIL), found by the
    /// sample's key (`tally_key`) in one lookup of a 16-byte entry, where
    /// a stack's id and then its entry in `counts` were two lookups, each
    /// a likely cache miss for a stack of the long tail (and 32-byte
    /// entries, twice the cache).
    tallies: KeyMap<(u32, u32)>,
    /// Each tally's key and its thread, idle and GIL, in the order met:
    /// read by `finish` only.
    tally_tags: Vec<(u64, usize, bool, bool)>,
    thread_ids: FxHashMap<u64, usize>,
    /// Each thread's run of equal samples so far.
    open: Vec<Option<Slice>>,
}

impl Profile {
    pub fn new(pid: u32, rate_hz: f64, started_at: f64) -> Profile {
        Profile {
            pid,
            rate_hz,
            started_at,
            ..Profile::default()
        }
    }

    pub fn frame(&mut self, key: FrameKey) -> usize {
        let at = FrameRef::of(&key);
        match self.known_frame(&at) {
            Some(id) => id,
            None => self.new_frame(at.sig(), key),
        }
    }

    fn known_frame(&self, frame: &FrameRef<'_>) -> Option<usize> {
        let mut at = self.frame_by_sig.get(&frame.sig()).copied().unwrap_or(NONE);
        while at != NONE {
            if frame.is(&self.frames[at]) {
                return Some(at);
            }
            at = self.frame_same_sig[at];
        }
        None
    }

    fn new_frame(&mut self, sig: u64, key: FrameKey) -> usize {
        let id = self.frames.len();
        self.frames.push(key);
        let next = self.frame_by_sig.insert(sig, id).unwrap_or(NONE);
        self.frame_same_sig.resize(id + 1, NONE);
        self.frame_same_sig[id] = next;
        id
    }

    pub fn thread(&mut self, id: u64, name: &str) -> usize {
        if let Some(&at) = self.thread_ids.get(&id) {
            if self.threads[at].name.is_empty() && !name.is_empty() {
                self.threads[at].name = name.to_string();
            }
            return at;
        }
        self.threads.push(ThreadInfo {
            id,
            name: name.to_string(),
        });
        self.thread_ids.insert(id, self.threads.len() - 1);
        self.threads.len() - 1
    }

    /// One thread's sample at `at_s` seconds since the start; `frames`,
    /// outermost first, as the sampler read them. Nothing is copied unless
    /// the stack is new.
    pub fn add_sample(
        &mut self,
        thread: usize,
        frames: &[FrameRef<'_>],
        idle: bool,
        gil: bool,
        at_s: f64,
    ) {
        let key = tally_key(stack_hash(frames), thread, idle, gil);
        let stack = match self.tallies.get_mut(&key) {
            Some((stack, count)) => {
                if *count == u32::MAX {
                    // A tally holds 4 G samples (7 weeks at 1 kHz); past
                    // that they go to `counts`.
                    *self
                        .counts
                        .entry(StackKey {
                            thread,
                            stack: *stack as usize,
                            idle,
                            gil,
                        })
                        .or_default() += u64::from(*count);
                    *count = 0;
                }
                *count += 1;
                *stack as usize
            }
            None => {
                let stack = self.new_tally(key, thread, frames, idle, gil);
                match u32::try_from(stack) {
                    Ok(id) => {
                        self.tallies.insert(key, (id, 1));
                        self.tally_tags.push((key, thread, idle, gil));
                    }
                    // Past what a tally holds (4 G stacks): counted the
                    // long way.
                    Err(_) => {
                        *self
                            .counts
                            .entry(StackKey {
                                thread,
                                stack,
                                idle,
                                gil,
                            })
                            .or_default() += 1
                    }
                }
                stack
            }
        };
        self.count_rest(
            StackKey {
                thread,
                stack,
                idle,
                gil,
            },
            at_s,
        );
    }

    /// The stack of a sample whose key is new: found by its key alone
    /// when another thread (or the same one, idle or not) was seen in it,
    /// interned otherwise.
    #[cold]
    fn new_tally(
        &mut self,
        key: u64,
        thread: usize,
        frames: &[FrameRef<'_>],
        idle: bool,
        gil: bool,
    ) -> usize {
        // The mix is an xor: the same call takes it off again.
        let stack_key = tally_key(key, thread, idle, gil);
        if let Some(&stack) = self.by_key.get(&stack_key) {
            return stack;
        }
        let ids: Vec<usize> = frames
            .iter()
            .map(|f| match self.known_frame(f) {
                Some(id) => id,
                None => self.new_frame(
                    f.sig(),
                    FrameKey {
                        func: f.func.to_string(),
                        file: f.file.to_string(),
                        line: f.line,
                    },
                ),
            })
            .collect();
        let stack = self.stack(ids);
        self.by_key.insert(stack_key, stack);
        stack
    }

    /// The same with `frames` already interned (frame indices).
    pub fn add(&mut self, thread: usize, frames: Vec<usize>, idle: bool, gil: bool, at_s: f64) {
        let stack = self.stack(frames);
        self.count(thread, stack, idle, gil, at_s);
    }

    fn stack(&mut self, frames: Vec<usize>) -> usize {
        match self.stack_ids.get(&frames) {
            Some(&id) => id,
            None => {
                self.stacks.push(frames.clone());
                self.stack_ids.insert(frames, self.stacks.len() - 1);
                self.stacks.len() - 1
            }
        }
    }

    /// The torch step the samples of the tick at `at_s` were taken in
    /// (None: not known).
    pub fn set_step(&mut self, step: Option<i64>, at_s: f64) {
        self.step = step;
        let Some(step) = step else { return };
        let tick = if self.rate_hz > 0.0 {
            1.0 / self.rate_hz
        } else {
            0.0
        };
        match self.step_spans.last_mut() {
            Some(last) if last.0 == step => last.2 = at_s + tick,
            last => {
                // A step's span is taken to last a tick past its last
                // sample; a tick read early (catching up) must not make it
                // overlap the next step's on the steps' lane.
                if let Some(last) = last {
                    last.2 = last.2.min(at_s);
                }
                self.step_spans.push((step, at_s, at_s + tick));
            }
        }
    }

    fn count(&mut self, thread: usize, stack: usize, idle: bool, gil: bool, at_s: f64) {
        let key = StackKey {
            thread,
            stack,
            idle,
            gil,
        };
        *self.counts.entry(key).or_default() += 1;
        self.count_rest(key, at_s);
    }

    /// All of `count` but `counts`.
    fn count_rest(&mut self, key: StackKey, at_s: f64) {
        if let Some(step) = self.step {
            *self.steps.entry((key, step)).or_default() += 1;
        }
        let interval = if self.rate_hz > 0.0 {
            1.0 / self.rate_hz
        } else {
            0.0
        };
        let thread = key.thread;
        if self.open.len() <= thread {
            self.open.resize(thread + 1, None);
        }
        match &mut self.open[thread] {
            Some(run)
                if run.stack as usize == key.stack
                    && Some(run.tag) == slice_tag(thread, key.idle, key.gil) =>
            {
                run.end_s = at_s + interval
            }
            open => {
                // A key past what a slice holds has no run: counted, not drawn.
                if let Some(done) = std::mem::replace(open, Slice::new(key, at_s, at_s + interval))
                {
                    self.slices.push(done);
                }
            }
        }
    }
    /// Closes the open runs and puts `add_sample`'s tallies in `counts`;
    /// call once sampling has ended.
    pub fn finish(&mut self, duration_s: f64) {
        self.duration_s = duration_s;
        self.slices.extend(self.open.drain(..).flatten());
        for (key, thread, idle, gil) in self.tally_tags.drain(..) {
            if let Some((stack, count)) = self.tallies.remove(&key) {
                *self
                    .counts
                    .entry(StackKey {
                        thread,
                        stack: stack as usize,
                        idle,
                        gil,
                    })
                    .or_default() += u64::from(count);
            }
        }
    }

    /// Only the samples `keep` says yes to (`--idle`, `--gil`, `--no-idle`).
    pub fn retain(&mut self, keep: impl Fn(&StackKey) -> bool) {
        self.counts.retain(|k, _| keep(k));
        self.steps.retain(|(k, _), _| keep(k));
        self.slices.retain(|s| keep(&s.key()));
    }

    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    /// (key, count), the most frequent first, ties in stack order: outputs
    /// are the same for the same samples.
    pub fn sorted_counts(&self) -> Vec<(StackKey, u64)> {
        let mut all: Vec<(StackKey, u64)> = self.counts.iter().map(|(k, v)| (*k, *v)).collect();
        all.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(p: &mut Profile, name: &str) -> usize {
        p.frame(FrameKey {
            func: name.into(),
            file: "/x/a.py".into(),
            line: 1,
        })
    }

    #[test]
    fn equal_stacks_fold_and_runs_become_slices() {
        let mut p = Profile::new(1, 100.0, 0.0);
        let t = p.thread(7, "MainThread");
        let (main, hot, cold) = (
            frame(&mut p, "main"),
            frame(&mut p, "hot"),
            frame(&mut p, "cold"),
        );
        for i in 0..3 {
            p.add(t, vec![main, hot], false, true, i as f64 * 0.01);
        }
        p.add(t, vec![main, cold], true, false, 0.03);
        p.finish(0.04);
        assert_eq!(p.stacks.len(), 2);
        assert_eq!(p.total(), 4);
        assert_eq!(p.sorted_counts()[0].1, 3);
        assert_eq!(p.slices.len(), 2);
        assert!((p.slices[0].end_s - 0.03).abs() < 1e-9, "{:?}", p.slices[0]);
        assert!(p.slices[1].key().idle);
    }

    #[test]
    fn borrowed_samples_fold_by_their_frames() {
        let mut p = Profile::new(1, 100.0, 0.0);
        let t = p.thread(7, "MainThread");
        let at = |line| {
            [
                FrameRef {
                    func: "main",
                    file: "/x/a.py",
                    line: 1,
                },
                FrameRef {
                    func: "hot",
                    file: "/x/a.py",
                    line,
                },
            ]
        };
        p.add_sample(t, &at(5), false, true, 0.0);
        p.add_sample(t, &at(5), false, true, 0.01);
        p.add_sample(t, &at(6), false, true, 0.02);
        p.finish(0.03);
        assert_eq!(p.stacks.len(), 2);
        assert_eq!(p.frames.len(), 3);
        assert_eq!(p.sorted_counts()[0].1, 2);
        // The same stack through the interned road lands on the same id.
        let (main, hot) = (p.stacks[0][0], p.stacks[0][1]);
        p.add(t, vec![main, hot], false, true, 0.03);
        assert_eq!(p.stacks.len(), 2);
        assert_eq!(p.sorted_counts()[0].1, 3);
    }

    fn sample(names: &[&str]) -> Vec<FrameRef<'static>> {
        // Leaked: each sample's strings are fresh allocations, as py-spy's
        // are, so nothing here is equal by address.
        names
            .iter()
            .map(|&name| {
                let (func, rest) = name.split_once('@').unwrap_or((name, "/x/a.py:1"));
                let (file, line) = rest.split_once(':').unwrap();
                FrameRef {
                    func: String::from(func).leak(),
                    file: String::from(file).leak(),
                    line: line.parse().unwrap(),
                }
            })
            .collect()
    }

    /// Frames that differ only where a frame's signature does not look (the
    /// middle of long names, one byte in 40) are still different frames.
    #[test]
    fn frames_alike_in_length_line_and_ends_stay_apart() {
        let long = |c: char| {
            format!(
                "fn_{}_tail_of_name@/long/path/{c}{}/module.py:7",
                "x".repeat(20),
                "y".repeat(30)
            )
        };
        let (a, b) = (long('a'), long('b'));
        // The premise: these two frames look alike to the index.
        assert_eq!(sample(&[&a])[0].sig(), sample(&[&b])[0].sig());
        let stacks = [
            vec!["main", a.as_str()],
            vec!["main", b.as_str()],
            vec!["main", "mid@/x/abcdefgh.py:3", a.as_str()],
            vec!["main", "mid@/x/abcdefgi.py:3", a.as_str()],
            vec!["main", "m@/x/a.py:3"],
            vec!["main", "n@/x/a.py:3"],
            vec!["main"],
            vec![],
        ];
        let mut p = Profile::new(1, 100.0, 0.0);
        let t = p.thread(7, "MainThread");
        let u = p.thread(8, "worker");
        for round in 0..3 {
            for (i, names) in stacks.iter().enumerate() {
                // Each stack twice in a row on one thread (the last stack's
                // road), and interleaved on another.
                p.add_sample(t, &sample(names), false, true, round as f64);
                p.add_sample(t, &sample(names), false, true, round as f64);
                p.add_sample(u, &sample(names), i % 2 == 0, false, round as f64);
            }
        }
        p.finish(3.0);
        assert_eq!(p.stacks.len(), stacks.len());
        for (i, names) in stacks.iter().enumerate() {
            let labels: Vec<String> = p.stacks[i]
                .iter()
                .map(|&f| {
                    let k = &p.frames[f];
                    format!("{}@{}:{}", k.func, k.file, k.line)
                })
                .collect();
            let want: Vec<String> = sample(names)
                .iter()
                .map(|f| format!("{}@{}:{}", f.func, f.file, f.line))
                .collect();
            assert_eq!(labels, want);
            let key = |thread, idle, gil| StackKey {
                thread,
                stack: i,
                idle,
                gil,
            };
            assert_eq!(p.counts[&key(t, false, true)], 6);
            assert_eq!(p.counts[&key(u, i % 2 == 0, false)], 3);
        }
        assert_eq!(p.total(), 9 * stacks.len() as u64);
    }

    /// Stacks that share their outer frames, sampled in a mixed order over
    /// two threads, fold as one map of (frames -> count) would.
    #[test]
    fn many_stacks_fold_exactly() {
        let mut rng = 1u64;
        let mut next = move || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) as usize
        };
        let names: Vec<String> = (0..50)
            .map(|i| format!("f{}@/p/m{}.py:{}", i % 7, i % 5, i % 3))
            .collect();
        let mut stacks: Vec<Vec<usize>> = vec![vec![0, 1, 2]];
        for i in 1..300 {
            let base = &stacks[next() % i];
            let mut s = base[..base.len() / 2].to_vec();
            let depth = 1 + next() % 12;
            while s.len() < depth {
                s.push(next() % names.len());
            }
            stacks.push(s);
        }
        let mut p = Profile::new(1, 100.0, 0.0);
        let threads = [p.thread(1, "a"), p.thread(2, "b")];
        let mut want: std::collections::HashMap<(usize, Vec<String>), u64> = Default::default();
        for i in 0..5000 {
            let s = &stacks[if next() % 3 == 0 {
                next() % 5
            } else {
                next() % stacks.len()
            }];
            let thread = threads[i % 2];
            let frames: Vec<&str> = s.iter().map(|&f| names[f].as_str()).collect();
            p.add_sample(thread, &sample(&frames), false, false, i as f64);
            let key: Vec<String> = frames.iter().map(|f| f.to_string()).collect();
            *want.entry((thread, key)).or_default() += 1;
        }
        p.finish(5000.0);
        let mut got: std::collections::HashMap<(usize, Vec<String>), u64> = Default::default();
        for (key, &n) in &p.counts {
            let frames: Vec<String> = p.stacks[key.stack]
                .iter()
                .map(|&f| {
                    let k = &p.frames[f];
                    format!("{}@{}:{}", k.func, k.file, k.line)
                })
                .collect();
            assert!(
                got.insert((key.thread, frames), n).is_none(),
                "a stack twice"
            );
        }
        assert_eq!(got, want);
    }

    /// A stack's key sees every byte: strings of each length up to 70
    /// that differ in one byte, or in their length alone, hash apart.
    #[test]
    fn every_byte_and_the_length_change_the_hash() {
        let hash = |bytes: &[u8], as_file: bool| {
            let name = std::str::from_utf8(bytes).unwrap();
            let (func, file) = if as_file {
                ("f", name)
            } else {
                (name, "/x/a.py")
            };
            frame_hash(
                &FrameRef {
                    func,
                    file,
                    line: 3,
                },
                K0,
            )
        };
        for n in 0..70usize {
            let base: Vec<u8> = (0..n).map(|i| b'a' + (i % 26) as u8).collect();
            for as_file in [false, true] {
                let h = hash(&base, as_file);
                for at in 0..n {
                    let mut other = base.clone();
                    other[at] ^= 1;
                    assert_ne!(h, hash(&other, as_file), "length {n}, byte {at}");
                }
                let mut longer = base.clone();
                longer.push(b'a');
                assert_ne!(h, hash(&longer, as_file), "length {n} and {}", n + 1);
            }
        }
        // A frame's line and where its names split count too.
        let f = |func, file, line| FrameRef { func, file, line };
        let key = |frames: &[FrameRef<'_>]| stack_hash(frames);
        assert_ne!(key(&[f("ab", "c", 1)]), key(&[f("a", "bc", 1)]));
        assert_ne!(key(&[f("a", "b", 1)]), key(&[f("a", "b", 2)]));
        assert_ne!(
            key(&[f("a", "b", 1), f("c", "d", 1)]),
            key(&[f("c", "d", 1), f("a", "b", 1)])
        );
        assert_ne!(key(&[]), key(&[f("", "", 0)]));
        // Stacks of every depth up to two rounds of the lanes: one frame
        // changed, anywhere, changes the key (lanes no frame reached
        // included).
        let base: Vec<FrameRef<'_>> = (0..9).map(|_| f("g", "/x/g.py", 1)).collect();
        for depth in 0..=base.len() {
            for at in 0..depth {
                let mut other = base[..depth].to_vec();
                other[at] = f("h", "/x/g.py", 1);
                assert_ne!(
                    key(&base[..depth]),
                    key(&other),
                    "depth {depth}, frame {at}"
                );
            }
        }
    }
}
