//! The `rankscope` command line.
//!
//! `rankscope PID <command>` acts on one process; the PID is rewritten into a
//! hidden `pid` subcommand before clap sees it.

mod align;
mod client;
mod commands;
mod hint;
mod outside;
mod stacks_text;
mod stuck;
mod term;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

const AFTER_HELP: &str = "\
Commands on one process (PID first):
  rankscope PID bt [--locals]        every thread's Python stack, innermost frame first (#N: the frame's number)
  rankscope PID eval CODE            run CODE in the target's __main__ and print the result
  rankscope PID eval --frame N CODE  run CODE in frame N of the main thread (--thread T: another thread)
  rankscope PID repl                 an interactive session in the target
  rankscope PID query SQL            SQL over python.backtrace, python.threads, python.torch_trace, process.info, ...
  rankscope PID break add FILE:LINE  a breakpoint that records a snapshot and goes on (--if, --log, --pause, ...)
  rankscope PID watch FILE:FUNC VAR  record each change of a local variable
  rankscope PID attach               pdb on a thread paused by a --pause breakpoint
  rankscope PID torch                the model(s), optimizer and step PyTorch has in the process
  rankscope PID torch trace on       per-module step timings into python.torch_trace (--every N, --modules GLOB, --backward)";

#[derive(Parser)]
#[command(name = "rankscope", version, about = "Look inside live Python and PyTorch processes", after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ListFormat {
    Table,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum BtFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum QueryFormat {
    Table,
    Csv,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// List the processes on this machine that have a live probe
    List {
        #[arg(long, value_enum, default_value = "table")]
        format: ListFormat,
    },
    /// Run a command with the probe on in it and in its Python children
    Run {
        /// Also listen on TCP (PORT, :PORT or HOST:PORT; loopback unless a host is given)
        #[arg(long)]
        listen: Option<String>,
        /// The command, after `--`
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Start a sample program under the probe and walk through what rankscope shows
    Demo {
        /// The Python interpreter to run the sample with
        #[arg(long)]
        python: Option<PathBuf>,
    },
    /// SQL over what processes left on disk (python.crashes); `rankscope PID query` asks a live process
    Query {
        sql: String,
        /// The run directory [default: RANKSCOPE_RUN_DIR, else every job under ~/.local/state/rankscope/runs]
        #[arg(long)]
        run: Option<PathBuf>,
        /// python.crashes keeps the job launcher's records too (launcher = true)
        #[arg(long)]
        all: bool,
        #[arg(long, value_enum, default_value = "table")]
        format: QueryFormat,
    },
    /// Every rank of a job at once: list, bt (grouped), eval, query
    Cluster {
        /// The job id (TORCHELASTIC_RUN_ID, SLURM_JOB_ID) [default: the one job running here]
        #[arg(long, global = true)]
        job: Option<String>,
        /// The job's run directory, where ranks register [default: RANKSCOPE_RUN_DIR, else every job's]
        #[arg(long, global = true)]
        run: Option<PathBuf>,
        /// Seconds each rank has to answer
        #[arg(long, global = true, default_value_t = 2.0)]
        timeout: f64,
        #[command(subcommand)]
        action: ClusterAction,
    },
    /// A pdb session in a crashed process held for a debugger (RANKSCOPE_ON_ERROR=socket)
    Debug {
        /// The rank to debug
        #[arg(long)]
        rank: Option<i64>,
        /// The process to debug
        #[arg(long)]
        pid: Option<u32>,
        /// The run directory [default: RANKSCOPE_RUN_DIR, else every job under ~/.local/state/rankscope/runs]
        #[arg(long)]
        run: Option<PathBuf>,
    },
    /// A Debug Adapter Protocol server, for debugging a running process from an editor (VSCode, nvim-dap, Emacs dape, Helix, Zed)
    ///
    /// `rankscope dap --listen 5678 --pid PID`, then in VSCode a debugpy "Remote Attach"
    /// configuration: {"type": "debugpy", "request": "attach", "connect": {"host": "127.0.0.1", "port": 5678}}.
    /// Editors that start their adapter run `rankscope dap --stdio --pid PID`. The process is
    /// attached as it runs (a probe is injected if it has none) and is never ended by the debugger.
    Dap {
        /// Wait for the editor on TCP: PORT, :PORT or HOST:PORT (loopback unless a host is given); after an editor leaves, the next may connect
        #[arg(long, value_name = "ADDR")]
        listen: Option<String>,
        /// Speak DAP on stdin/stdout, for an editor that starts the adapter; exits when the session ends
        #[arg(long)]
        stdio: bool,
        /// The process to debug (a probe is started in it if it has none)
        #[arg(long)]
        pid: Option<u32>,
        /// The process of this rank of the job running on this machine
        #[arg(long)]
        rank: Option<i64>,
        /// Every rank of the job on this machine, in one session (threads named `rank N / ...`); a breakpoint whose condition names ranks (`rank == 1 and ...`, `rank in (1, 2)`) goes to those ranks only
        #[arg(long)]
        job: bool,
        /// With --listen: the editor must send this as "rankscopeToken" in its attach configuration [default: RANKSCOPE_TOKEN]; required for a non-loopback address
        #[arg(long)]
        token: Option<String>,
        /// Seconds the probe waits to hear from the adapter before it ends the session itself (breakpoints removed, stopped threads resumed), should the adapter die
        #[arg(long, default_value_t = 10.0)]
        lease: f64,
        /// Print every DAP message in and out on stderr
        #[arg(long)]
        trace: bool,
    },
    /// Start the probe inside a running Python process that was started without it; on a launcher (torchrun), in each of its ranks
    Inject {
        /// A Python process, or a launcher whose descendants carry RANK
        pid: u32,
        /// Seconds to wait for the probe to answer
        #[arg(long, default_value_t = 5.0)]
        timeout: f64,
    },
    /// Uncaught exceptions and native crashes recorded by probes (readable after the process is gone)
    Crashes {
        /// The run directory [default: RANKSCOPE_RUN_DIR, else every job under ~/.local/state/rankscope/runs]
        #[arg(long, global = true)]
        run: Option<PathBuf>,
        /// Also the job launcher's records (torchrun's own exit: SIGTERM, a failed worker), marked `launcher`
        #[arg(long)]
        all: bool,
        #[arg(long, value_enum, default_value = "table", global = true)]
        format: ListFormat,
        #[command(subcommand)]
        action: Option<CrashesAction>,
    },
    #[command(name = "pid", hide = true)]
    Pid {
        pid: u32,
        #[command(subcommand)]
        action: Action,
    },
}

/// Where eval and repl run code: `__main__`, or a frame of a thread.
#[derive(Args, Clone, Default)]
pub struct FrameArgs {
    /// Run in a frame of this thread: its name, its id as `bt` prints it (0x...), or its tid [default: the main thread]
    #[arg(long)]
    pub thread: Option<String>,
    /// Run in this frame, with its locals and globals: its number in `bt` (#N; 0 = innermost) [default: 0 with --thread]
    #[arg(long)]
    pub frame: Option<u32>,
}

#[derive(Subcommand)]
pub enum BreakAction {
    /// Set a breakpoint at FILE:LINE or FILE:FUNCTION (a file name or the end of its path; Class.method)
    Add {
        spec: String,
        /// Record only when this Python expression is true in the frame
        #[arg(long = "if")]
        condition: Option<String>,
        /// A logpoint: record this f-string template instead of locals, e.g. "step {step}"
        #[arg(long)]
        log: Option<String>,
        /// Remove the breakpoint after this many recorded hits
        #[arg(long)]
        max: Option<u64>,
        /// Record every Nth pass only
        #[arg(long)]
        every: Option<u64>,
        /// Record from the Nth pass on
        #[arg(long)]
        hit: Option<u64>,
        /// Also pause the thread that hits, for `rankscope PID attach`; the other threads run on
        #[arg(long)]
        pause: bool,
        /// Seconds a paused thread waits for `attach` (and for each command in it) before it resumes
        #[arg(long, requires = "pause")]
        pause_timeout: Option<f64>,
    },
    /// The breakpoints set, with their pass and hit counts
    List {
        #[arg(long, value_enum, default_value = "table")]
        format: ListFormat,
    },
    /// Remove one breakpoint
    Rm { id: u64 },
    /// Remove every breakpoint; the code runs as before
    Clear,
}

#[derive(Subcommand)]
enum ClusterAction {
    /// The job's ranks: rank, local rank, host, pid, state, uptime
    List {
        #[arg(long, value_enum, default_value = "table")]
        format: ListFormat,
    },
    /// Every rank's main-thread stack, identical stacks grouped, outliers marked
    Bt {
        /// Only these ranks (e.g. 0,2,4-7)
        #[arg(long)]
        ranks: Option<String>,
        /// Group stacks by function and file only
        #[arg(long)]
        ignore_lines: bool,
        /// Also show rankscope's own frames (its wrappers and hooks)
        #[arg(long)]
        all_frames: bool,
    },
    /// Run Python code on every rank (or --ranks) and show each result under its rank
    Eval {
        code: String,
        #[arg(long)]
        ranks: Option<String>,
        /// Interrupt the code after this many seconds
        #[arg(long = "eval-timeout", default_value_t = 10.0)]
        eval_timeout: f64,
        #[command(flatten)]
        at: FrameArgs,
    },
    /// One line per rank: RSS, USS, CUDA peak, growth since the last look; the outlier marked
    Memory {
        /// Only these ranks (e.g. 2 or 0,4-7)
        #[arg(long)]
        ranks: Option<String>,
        #[arg(long, value_enum, default_value = "text")]
        format: BtFormat,
    },
    /// Crashes recorded by the job's ranks [default job: the running one, else the one that ran last]
    Crashes {
        /// Also the job launcher's records (torchrun's own exit), marked `launcher`
        #[arg(long)]
        all: bool,
        #[arg(long, value_enum, default_value = "table")]
        format: ListFormat,
    },
    /// Breakpoints on every rank (or --ranks) at once: add, list, rm, clear
    Break {
        /// Only these ranks (e.g. 2 or 0,4-7)
        #[arg(long, global = true)]
        ranks: Option<String>,
        #[command(subcommand)]
        action: BreakAction,
    },
    /// PyTorch on every rank (or --ranks) at once: what each found, the trace on and off
    Torch {
        /// Only these ranks (e.g. 2 or 0,4-7)
        #[arg(long, global = true)]
        ranks: Option<String>,
        #[command(subcommand)]
        action: Option<TorchAction>,
        #[arg(long, value_enum, default_value = "text", global = true)]
        format: BtFormat,
    },
    /// Sample every rank at once from outside, without stopping them: a flame graph of all ranks merged (each frame names the ranks it was seen on), a Chrome trace with a process per rank, or one rank against the others (--diff)
    Profile {
        /// Only these ranks (e.g. 0-7)
        #[arg(long)]
        ranks: Option<String>,
        /// This rank against the median of the others: a differential flame graph (.svg), folded before/after counts (.folded), or a table
        #[arg(long)]
        diff: Option<i64>,
        #[command(flatten)]
        args: commands::profile::ProfileArgs,
    },
    /// SQL over the tables of every rank, as one table with a rank column
    Query {
        sql: String,
        #[arg(long)]
        ranks: Option<String>,
        #[arg(long, value_enum, default_value = "table")]
        format: QueryFormat,
        /// python.backtrace keeps rankscope's own frames (and counts them in depth)
        #[arg(long)]
        all_frames: bool,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    On,
    Off,
}

#[derive(Subcommand)]
pub enum TorchAction {
    /// Per-module forward (and backward) times of sampled steps, into python.torch_trace and python.torch_steps
    Trace {
        #[command(subcommand)]
        action: TraceAction,
    },
    /// The NaN/Inf watch: `nan on` arms it (loss and gradient norms checked each step), `nan` shows where the first non-finite value came from
    Nan {
        /// on: arm the watch; off: disarm it; none: what it found
        switch: Option<Switch>,
    },
    /// Gradient statistics per parameter into python.grad_stats (norm, max |g|, non-finite count, update/weight ratio, flag)
    Grads {
        /// on or off; none: on (every 10 steps), or while on, the last sampled step
        switch: Option<Switch>,
        /// Every Nth step (the same steps on every rank; 10 when not given)
        #[arg(long)]
        every: Option<u64>,
    },
    /// Output statistics of the chosen modules into python.activation_stats (mean, std, max |x|, zero fraction)
    Activations {
        /// on or off; none: on, or while on, what it covers
        switch: Option<Switch>,
        /// The modules whose qualified name matches this glob (e.g. 'layer3.*'; all when not given)
        #[arg(long)]
        modules: Option<String>,
        /// Every Nth step (1 when not given)
        #[arg(long)]
        every: Option<u64>,
    },
    /// torch.distributed collectives into python.collectives; none: each group's last and in-flight ones
    Collectives {
        /// on or off; none: what was recorded
        switch: Option<Switch>,
    },
}

#[derive(Subcommand)]
pub enum MemoryAction {
    /// Record allocation sites: tracemalloc for Python (--python, the default), torch's CUDA memory history (--cuda)
    Track {
        switch: Switch,
        #[arg(long)]
        python: bool,
        #[arg(long)]
        cuda: bool,
    },
    /// What grew since the last look (or since tracking began), by allocation site, with its stack
    Diff {
        /// Between two torch steps instead: A..B, from the end of step A to the end of step B (waits for them)
        #[arg(long)]
        steps: Option<String>,
        /// With --steps: how long to wait for step B, in seconds
        #[arg(long, default_value_t = 600.0)]
        wait: f64,
    },
    /// A snapshot of CUDA's allocations that PyTorch's memory_viz opens (`export cuda OUT.pickle`)
    Export {
        /// What to export: cuda
        what: String,
        /// Where to write it (a path on the target's machine)
        path: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum TraceAction {
    /// Hook the models' modules around every Nth step (the same steps on every rank)
    On {
        /// Trace the steps whose number is a multiple of N; the others run with no module hook
        #[arg(long, default_value_t = 1)]
        every: u64,
        /// Only the modules whose qualified name matches this glob (e.g. 'encoder.*'); the model itself is named by its class
        #[arg(long, default_value = "*")]
        modules: String,
        /// Also time each module's backward (tensor hooks on its outputs and inputs)
        #[arg(long)]
        backward: bool,
    },
    /// Remove every hook: the model runs as it did before
    Off,
}

#[derive(Subcommand)]
enum CrashesAction {
    /// One record as a traceback: the exception chain, then frames innermost last, with their locals
    Show {
        /// The ID that `rankscope crashes` lists
        id: usize,
    },
}

#[derive(Subcommand)]
pub enum Action {
    /// Every thread's Python stack, innermost frame first, at the line running now
    Bt {
        /// Show each frame's locals (bounded, safe reprs)
        #[arg(long)]
        locals: bool,
        /// Interleave native (C, C++, Rust) frames, read from outside the process
        #[arg(long)]
        native: bool,
        #[arg(long, value_enum, default_value = "text")]
        format: BtFormat,
        /// Seconds to wait for the probe before reading the stacks from
        /// outside the process instead [default: 1]
        #[arg(long)]
        timeout: Option<f64>,
        /// Also show rankscope's own frames (its wrappers and hooks); they then count in the #N numbers
        #[arg(long)]
        all_frames: bool,
    },
    /// Run Python code in the target's __main__ namespace, or in a frame (--frame, --thread)
    Eval {
        /// The code; a trailing expression's repr is printed
        #[arg(required_unless_present = "file")]
        code: Option<String>,
        /// Read the code from a file instead
        #[arg(long, short)]
        file: Option<PathBuf>,
        /// Interrupt the code after this many seconds
        #[arg(long, default_value_t = 10.0)]
        timeout: f64,
        #[command(flatten)]
        at: FrameArgs,
    },
    /// An interactive Python session inside the target
    Repl {
        /// Interrupt each input after this many seconds [default: none; Ctrl-C interrupts]
        #[arg(long)]
        timeout: Option<f64>,
        #[command(flatten)]
        at: FrameArgs,
    },
    /// Breakpoints that record a snapshot (or a log line) and go on, or pause one thread
    Break {
        #[command(subcommand)]
        action: BreakAction,
    },
    /// Record each change of a local variable inside a function, with the line that changed it
    Watch {
        /// The function: FILE:FUNCTION (e.g. train.py:train_step, model.py:Attention.forward)
        spec: String,
        /// The local variable
        name: String,
        /// The variable is a tensor: record in-place changes (its version counter moves)
        #[arg(long)]
        tensor: bool,
    },
    /// A pdb session on a thread paused by a `--pause` breakpoint (c, q or Ctrl-C resume it)
    Attach {
        /// The paused thread's name, when several are paused
        #[arg(long)]
        thread: Option<String>,
        /// Seconds to wait for a thread to pause
        #[arg(long, default_value_t = 30.0)]
        wait: f64,
    },
    /// What breakpoints recorded: time, breakpoint, thread, stack, locals
    Snapshots {
        #[arg(long, value_enum, default_value = "text")]
        format: BtFormat,
    },
    /// PyTorch in the process: the model(s), optimizer and step; `torch trace on|off`
    Torch {
        #[command(subcommand)]
        action: Option<TorchAction>,
        #[arg(long, value_enum, default_value = "text", global = true)]
        format: BtFormat,
    },
    /// Memory: RSS/USS, the Python heap, CUDA, the largest tensors and who holds them, growth since the last look; `memory track|diff|export`
    Memory {
        #[command(subcommand)]
        action: Option<MemoryAction>,
        /// How many of the largest tensors (or growing sites) to show
        #[arg(long, default_value_t = 5, global = true)]
        top: usize,
        #[arg(long, value_enum, default_value = "text", global = true)]
        format: BtFormat,
    },
    /// Sample the process for a while (from outside: it never stops) and write a flame graph or trace; the format follows -o's extension
    Profile(commands::profile::ProfileArgs),
    /// Run SQL over the process's tables (SHOW TABLES lists them)
    Query {
        sql: String,
        /// python.backtrace gets native frames too (frame_type = 'Native'), read from outside
        #[arg(long)]
        native: bool,
        #[arg(long, value_enum, default_value = "table")]
        format: QueryFormat,
        /// python.backtrace keeps rankscope's own frames (and counts them in depth)
        #[arg(long)]
        all_frames: bool,
    },
}

fn run_cluster(
    job: Option<String>,
    run: Option<PathBuf>,
    timeout: f64,
    action: ClusterAction,
) -> anyhow::Result<u8> {
    use commands::cluster;
    if !(timeout.is_finite() && timeout > 0.0 && timeout <= commands::MAX_WAIT_S) {
        return Err(hint::Hinted::new(
            format!("--timeout must be a positive number of seconds up to a day, not {timeout}"),
            "e.g. --timeout 2",
        )
        .into());
    }
    let deadline = std::time::Duration::from_secs_f64(timeout);
    let job = job.as_deref();
    match action {
        ClusterAction::List { format } => cluster::list(job, run, deadline, format),
        ClusterAction::Bt {
            ranks,
            ignore_lines,
            all_frames,
        } => cluster::bt(
            job,
            run,
            ranks.as_deref(),
            ignore_lines,
            all_frames,
            deadline,
        ),
        ClusterAction::Eval {
            code,
            ranks,
            eval_timeout,
            at,
        } => cluster::eval(job, run, ranks.as_deref(), &code, eval_timeout, at),
        ClusterAction::Crashes { all, format } => cluster::crashes(job, run, all, format),
        ClusterAction::Memory { ranks, format } => {
            cluster::memory(job, run, ranks.as_deref(), format)
        }
        ClusterAction::Torch {
            ranks,
            action,
            format,
        } => cluster::torch(job, run, ranks.as_deref(), action.as_ref(), format),
        ClusterAction::Break { ranks, action } => {
            cluster::breakpoints(job, run, ranks.as_deref(), &action)
        }
        ClusterAction::Query {
            sql,
            ranks,
            format,
            all_frames,
        } => cluster::query(job, run, ranks.as_deref(), &sql, format, all_frames),
        ClusterAction::Profile { ranks, diff, args } => {
            commands::profile::cluster(job, run, ranks.as_deref(), diff, args)
        }
    }
}

/// `rankscope 123 bt` -> `rankscope pid 123 bt`, and
/// `rankscope --job HOST:PORT cluster bt` -> `rankscope cluster --job HOST:PORT bt`.
fn rewrite_pid_form(mut args: Vec<String>) -> Vec<String> {
    if args.len() > 1 && !args[1].is_empty() && args[1].bytes().all(|b| b.is_ascii_digit()) {
        args.insert(1, "pid".to_string());
    }
    let job_args = match args.get(1).map(String::as_str) {
        Some("--job") if args.get(3).map(String::as_str) == Some("cluster") => 2,
        Some(flag)
            if flag.starts_with("--job=") && args.get(2).map(String::as_str) == Some("cluster") =>
        {
            1
        }
        _ => 0,
    };
    if job_args > 0 {
        let job: Vec<String> = args.drain(1..1 + job_args).collect();
        args.splice(2..2, job);
    }
    args
}

fn main() -> ExitCode {
    // `rankscope PID snapshots | head`: a closed pipe ends us quietly, as it
    // does any Unix tool, instead of a panic in println!.
    // SAFETY: restoring the default disposition of one signal at start-up.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // `std::env::args()` panics on an argument that is not UTF-8.
    let mut args = Vec::new();
    for arg in std::env::args_os() {
        match arg.into_string() {
            Ok(arg) => args.push(arg),
            Err(bad) => {
                eprintln!(
                    "error: an argument is not valid UTF-8: {}\nhint: rankscope takes UTF-8 text (SQL, code, paths)",
                    bad.to_string_lossy()
                );
                return ExitCode::from(2);
            }
        }
    }
    let cli = Cli::parse_from(rewrite_pid_form(args));
    let result = match cli.command {
        Command::List { format } => commands::list::run(format),
        Command::Run { listen, command } => commands::run::run(listen, command),
        Command::Query {
            sql,
            run,
            all,
            format,
        } => commands::query::run_offline(run, all, &sql, format),
        Command::Cluster {
            job,
            run,
            timeout,
            action,
        } => run_cluster(job, run, timeout, action),
        Command::Debug { rank, pid, run } => commands::debug::run(rank, pid, run),
        Command::Inject { pid, timeout } => commands::inject::run(pid, timeout),
        Command::Dap {
            listen,
            stdio,
            pid,
            rank,
            job,
            token,
            lease,
            trace,
        } => commands::dap::run(commands::dap::DapArgs {
            listen,
            stdio,
            pid,
            rank,
            job,
            token,
            lease,
            trace,
        }),
        Command::Demo { python } => commands::demo::run(python),
        Command::Crashes {
            run,
            all,
            format,
            action,
        } => match action {
            None => {
                commands::crashes::list(run, format, &commands::crashes::Select { all, keep: None })
            }
            Some(CrashesAction::Show { id }) => commands::crashes::show(id, run, format),
        },
        Command::Pid { pid, action } => commands::on_pid(pid, action),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(err) => ExitCode::from(hint::report(&err) as u8),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn a_leading_pid_becomes_the_pid_subcommand() {
        assert_eq!(
            rewrite_pid_form(args("rankscope 42 bt")),
            args("rankscope pid 42 bt")
        );
        assert_eq!(
            rewrite_pid_form(args("rankscope list")),
            args("rankscope list")
        );
        assert_eq!(
            rewrite_pid_form(args("rankscope --job n7:4000 cluster bt")),
            args("rankscope cluster --job n7:4000 bt")
        );
        assert_eq!(
            rewrite_pid_form(args("rankscope --job=n7:4000 cluster bt")),
            args("rankscope cluster --job=n7:4000 bt")
        );
    }

    #[test]
    fn the_cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn run_keeps_the_commands_own_flags() {
        let cli = Cli::try_parse_from(args("rankscope run -- python -u train.py --lr 3")).unwrap();
        match cli.command {
            Command::Run { command, .. } => assert_eq!(command, args("python -u train.py --lr 3")),
            _ => panic!("parsed as another command"),
        }
    }
}
