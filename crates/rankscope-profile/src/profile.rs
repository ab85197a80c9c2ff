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

/// A stack's signature is folded frame by frame, outermost first, so that
/// a prefix's is where the rest of the stack's starts from.
const SIG_START: u64 = 0x243f_6a88_85a3_08d3;

#[inline]
fn sig_step(sig: u64, frame: &FrameRef<'_>) -> u64 {
    sig.rotate_left(5) ^ frame.sig()
}

#[inline]
fn sig_end(sig: u64, frames: usize) -> u64 {
    sig.rotate_left(5) ^ frames as u64
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

/// The interned frames again, as the fold compares them: each one's line
/// and lengths side by side in `heads`, and its names one after the other
/// in `text`, so that a frame is read from two places close to others
/// where a `FrameKey` and its two strings were three places on the heap.
#[derive(Debug, Clone, Default)]
struct FrameTexts {
    heads: Vec<FrameHead>,
    text: Vec<u8>,
}

#[derive(Debug, Clone, Copy)]
struct FrameHead {
    line: i64,
    func: usize,
    file: usize,
    /// Where its function's name starts in `text`, the file's after it.
    at: usize,
}

impl FrameTexts {
    fn push(&mut self, key: &FrameKey) {
        self.heads.push(FrameHead {
            line: key.line,
            func: key.func.len(),
            file: key.file.len(),
            at: self.text.len(),
        });
        self.text.extend_from_slice(key.func.as_bytes());
        self.text.extend_from_slice(key.file.as_bytes());
    }

    /// Whether `frame` is frame `id` of `keys`.
    #[inline(always)]
    fn is(&self, id: usize, frame: &FrameRef<'_>, keys: &[FrameKey]) -> bool {
        // A frame put in `Profile::frames` other than by `Profile::frame`
        // has no text here.
        let Some(head) = self.heads.get(id) else {
            return frame.is(&keys[id]);
        };
        let (func, file) = (frame.func.as_bytes(), frame.file.as_bytes());
        if head.line != frame.line || head.func != func.len() || head.file != file.len() {
            return false;
        }
        let (func_at, file_at) =
            self.text[head.at..head.at + head.func + head.file].split_at(head.func);
        same_bytes(func, func_at) && same_bytes(file, file_at)
    }
}

/// The end of a chain of `frame_same_sig`.
const NONE: usize = usize::MAX;

/// The stacks seen through `add_sample`, by signature. Finding a stack
/// among many costs cache misses as much as instructions: samples come in
/// no order, and most of a long tail of stacks is out of the cache when its
/// next sample comes. So what is read for a sample is kept small and close
/// together: a slot of 8 bytes (a tag from the signature and the stack's
/// id; about 512 KB for 50 k stacks) and the stack's frame ids, copied as
/// u32 one after another in `records`, where `stacks` through a hash map
/// cost four reads (control bytes, bucket, the Vec, its contents) in more
/// than twice the memory. The slot gives the stack's id before its frames
/// are read, so that its count is looked up while they are compared.
/// Open addressing with linear probing; every slot with the sample's tag
/// is a candidate, compared frame by frame before it is taken.
#[derive(Debug, Clone, Default)]
struct StackIndex {
    /// `tag << 32 | stack + 1`; 0 is empty.
    slots: Vec<u64>,
    used: usize,
    /// 64 less log2 of the slots: a slot's home is the top of its tag.
    shift: u32,
    /// Where each stack's frames start in `records` (its length, then the
    /// ids); u32::MAX for a stack not in the index.
    starts: Vec<u32>,
    records: Vec<u32>,
}

impl StackIndex {
    /// The signature's tag: its top 32 bits after a multiply, because the
    /// signature's own low bits vary little from stack to stack.
    #[inline]
    fn tag(sig: u64) -> u64 {
        sig.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32
    }

    #[inline]
    fn home(&self, tag: u64) -> usize {
        ((tag << 32) >> self.shift) as usize
    }

    /// The stacks that may be the one with `sig`.
    #[inline]
    fn candidates(&self, sig: u64) -> impl Iterator<Item = usize> + '_ {
        let tag = Self::tag(sig);
        let mask = self.slots.len().wrapping_sub(1);
        let mut at = if self.slots.is_empty() {
            0
        } else {
            self.home(tag)
        };
        std::iter::from_fn(move || loop {
            let slot = *self.slots.get(at)?;
            if slot == 0 {
                return None;
            }
            at = (at + 1) & mask;
            if slot >> 32 == tag {
                return Some((slot & u64::from(u32::MAX)) as usize - 1);
            }
        })
    }

    /// A stack's frame ids, if it is in the index.
    #[inline]
    fn frames(&self, stack: usize) -> Option<&[u32]> {
        let start = *self.starts.get(stack)? as usize;
        let len = *self.records.get(start)? as usize;
        Some(&self.records[start + 1..start + 1 + len])
    }

    /// Adds a stack not in the index, if u32 can describe it; one that it
    /// cannot takes the slow road.
    fn insert(&mut self, sig: u64, stack: usize, frames: &[usize]) -> bool {
        let start = self.records.len();
        let fits = |n: usize| n < u32::MAX as usize - 1;
        if !(fits(start) && fits(stack) && fits(frames.len()) && frames.iter().all(|&f| fits(f))) {
            return false;
        }
        if (self.used + 1) * 8 > self.slots.len() * 7 {
            self.grow();
        }
        self.records.push(frames.len() as u32);
        self.records.extend(frames.iter().map(|&f| f as u32));
        if self.starts.len() <= stack {
            self.starts.resize(stack + 1, u32::MAX);
        }
        self.starts[stack] = start as u32;
        self.place((Self::tag(sig) << 32) | (stack as u64 + 1));
        self.used += 1;
        true
    }

    fn place(&mut self, slot: u64) {
        let mask = self.slots.len() - 1;
        let mut at = self.home(slot >> 32);
        while self.slots[at] != 0 {
            at = (at + 1) & mask;
        }
        self.slots[at] = slot;
    }

    fn grow(&mut self) {
        let size = (self.slots.len() * 2).max(1024);
        let old = std::mem::replace(&mut self.slots, vec![0; size]);
        self.shift = 64 - size.trailing_zeros();
        for slot in old.into_iter().filter(|&s| s != 0) {
            self.place(slot);
        }
    }
}

/// A thread's last stack found through the index, and the signature of
/// each of its prefixes (`sigs[i]`: of its first i frames): the next
/// sample of the thread is compared with it first, and what it shares
/// with it needs neither a signature nor a second comparison.
#[derive(Debug, Clone, Default)]
struct Recent {
    stack: Option<usize>,
    sigs: Vec<u64>,
}

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

/// A run of consecutive samples of one thread with the same stack.
#[derive(Debug, Clone, PartialEq)]
pub struct Slice {
    pub thread: usize,
    pub stack: usize,
    pub idle: bool,
    pub gil: bool,
    pub start_s: f64,
    pub end_s: f64,
}

#[derive(Debug, Default, Clone)]
pub struct Profile {
    pub pid: u32,
    pub rank: Option<i64>,
    /// Interned frames; a stack holds their indices, outermost first.
    pub frames: Vec<FrameKey>,
    pub stacks: Vec<Vec<usize>>,
    pub threads: Vec<ThreadInfo>,
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
    texts: FrameTexts,
    stack_ids: FxHashMap<Vec<usize>, usize>,
    index: StackIndex,
    recent: FxHashMap<usize, Recent>,
    thread_ids: FxHashMap<u64, usize>,
    open: FxHashMap<usize, Slice>,
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
        // Frames pushed to `frames` from outside get their text here, so
        // that `texts` stays indexed by frame id.
        for old in self.frames.iter().skip(self.texts.heads.len()) {
            self.texts.push(old);
        }
        let id = self.frames.len();
        self.texts.push(&key);
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
        let recent = self.recent.entry(thread).or_default();
        let prev: &[u32] = recent
            .stack
            .and_then(|stack| self.index.frames(stack))
            .unwrap_or(&[]);
        let shared = frames
            .iter()
            .zip(prev)
            .take_while(|&(f, &id)| self.texts.is(id as usize, f, &self.frames))
            .count();
        if let Some(stack) = recent.stack {
            if shared == frames.len() && shared == prev.len() {
                self.count(thread, stack, idle, gil, at_s);
                return;
            }
        }
        // The signature of the frames shared with the last stack is known.
        if recent.sigs.is_empty() {
            recent.sigs.push(SIG_START);
        }
        recent.sigs.resize(frames.len() + 1, 0);
        let (known, rest) = recent.sigs.split_at_mut(shared + 1);
        let mut sig = known[shared];
        for (f, at) in frames[shared..].iter().zip(rest) {
            sig = sig_step(sig, f);
            *at = sig;
        }
        let sig = sig_end(sig, frames.len());
        let prefix = &prev[..shared];
        let mut found = None;
        for stack in self.index.candidates(sig) {
            let key = StackKey {
                thread,
                stack,
                idle,
                gil,
            };
            // Asked before the comparison below, not after, so that the
            // two reads from memory overlap; dropped if it is not the
            // sample's stack.
            let count = self.counts.entry(key);
            let ids = self.index.frames(stack).unwrap_or(&[]);
            if ids.len() == frames.len()
                && ids[..shared] == *prefix
                && ids[shared..]
                    .iter()
                    .zip(&frames[shared..])
                    .all(|(&id, f)| self.texts.is(id as usize, f, &self.frames))
            {
                *count.or_default() += 1;
                recent.stack = Some(stack);
                found = Some(key);
                break;
            }
        }
        if let Some(key) = found {
            self.count_rest(key, at_s);
            return;
        }
        let mut ids: Vec<usize> = prefix.iter().map(|&id| id as usize).collect();
        for f in &frames[shared..] {
            let id = match self.known_frame(f) {
                Some(id) => id,
                None => self.new_frame(
                    f.sig(),
                    FrameKey {
                        func: f.func.to_string(),
                        file: f.file.to_string(),
                        line: f.line,
                    },
                ),
            };
            ids.push(id);
        }
        // A stack made by `add` is not in the index yet; one that was would
        // have been found above.
        let stack = self.stack(ids);
        let indexed = self.index.insert(sig, stack, &self.stacks[stack]);
        let recent = self.recent.entry(thread).or_default();
        recent.stack = indexed.then_some(stack);
        self.count(thread, stack, idle, gil, at_s);
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
            _ => self.step_spans.push((step, at_s, at_s + tick)),
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
        let StackKey {
            thread,
            stack,
            idle,
            gil,
        } = key;
        match self.open.get_mut(&thread) {
            Some(run) if run.stack == stack && run.idle == idle && run.gil == gil => {
                run.end_s = at_s + interval
            }
            _ => {
                let run = Slice {
                    thread,
                    stack,
                    idle,
                    gil,
                    start_s: at_s,
                    end_s: at_s + interval,
                };
                if let Some(done) = self.open.insert(thread, run) {
                    self.slices.push(done);
                }
            }
        }
    }
    /// Closes the open runs; call once sampling has ended.
    pub fn finish(&mut self, duration_s: f64) {
        self.duration_s = duration_s;
        let mut open: Vec<Slice> = self.open.drain().map(|(_, s)| s).collect();
        open.sort_by_key(|s| s.thread);
        self.slices.extend(open);
    }

    /// Only the samples `keep` says yes to (`--idle`, `--gil`, `--no-idle`).
    pub fn retain(&mut self, keep: impl Fn(&StackKey) -> bool) {
        self.counts.retain(|k, _| keep(k));
        self.steps.retain(|(k, _), _| keep(k));
        self.slices.retain(|s| {
            keep(&StackKey {
                thread: s.thread,
                stack: s.stack,
                idle: s.idle,
                gil: s.gil,
            })
        });
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
        assert!(p.slices[1].idle);
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
}
