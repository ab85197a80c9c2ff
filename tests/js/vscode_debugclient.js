// Microsoft's own DAP test client (`@vscode/debugadapter-testsupport`)
// against `rankscope dap --listen`: the configuration sequence an editor
// runs, a breakpoint in a running loop, its stack, scopes and variables,
// continue, and disconnect.
//
// node vscode_debugclient.js '{"modules": DIR, "port": N, "path": FILE, "line": N}'
//
// `modules` is the node_modules folder the package was installed in. Each
// stage prints `ok STAGE ...`; the first failure prints `FAIL STAGE: why`
// and exits 1. In server mode (start(port)) DebugClient has no timeouts of
// its own, so every wait here has one.

"use strict";

const assert = require("assert");
const path = require("path");

const config = JSON.parse(process.argv[2]);
const { DebugClient } = require(path.join(config.modules, "@vscode", "debugadapter-testsupport"));

const WAIT_MS = 20000;
let stage = "start";

function fail(why) {
    console.log(`FAIL ${stage}: ${why && why.stack ? why.stack : why}`);
    process.exit(1);
}

process.on("uncaughtException", fail);
process.on("unhandledRejection", fail);

function within(promise, what, ms = WAIT_MS) {
    let timer;
    const timeout = new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error(`${what}: nothing within ${ms} ms`)), ms);
    });
    return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

function ok(text) {
    console.log(`ok ${stage}${text ? " " + text : ""}`);
}

async function stepOf(dc, frameId) {
    const scopes = (await within(dc.scopesRequest({ frameId }), "scopes")).body.scopes;
    const locals = scopes.find((s) => s.name === "Locals");
    assert.ok(locals && locals.variablesReference > 0, `no Locals scope: ${JSON.stringify(scopes)}`);
    const variables = (await within(dc.variablesRequest({ variablesReference: locals.variablesReference }), "variables")).body.variables;
    const step = variables.find((v) => v.name === "step");
    assert.ok(step, `no local "step": ${JSON.stringify(variables)}`);
    assert.match(step.value, /^\d+$/);
    return Number(step.value);
}

async function main() {
    const dc = new DebugClient("node", "", "rankscope");
    dc.on("terminated", () => fail("the adapter sent `terminated`: the target is gone"));
    const source = { path: config.path };

    await within(dc.start(config.port), "connect");
    dc._socket.on("error", fail);
    ok(`127.0.0.1:${config.port}`);

    stage = "initialize";
    const init = await within(
        dc.initializeRequest({
            clientID: "vscode-debugadapter-testsupport",
            adapterID: "rankscope",
            linesStartAt1: true,
            columnsStartAt1: true,
            pathFormat: "path",
            supportsVariableType: true,
        }),
        "initialize"
    );
    assert.strictEqual(init.body.supportsConfigurationDoneRequest, true);
    assert.strictEqual(init.body.supportsConditionalBreakpoints, true);
    ok();

    // configurationSequence() sends configurationDone only when the client
    // saw supportsConfigurationDoneRequest, which DebugClient learns in
    // launch() alone; an attach session tells it here, as launch() would
    // (otherwise it sends setExceptionBreakpoints({filters: ["all"]})).
    stage = "attach + configurationSequence";
    assert.ok("_supportsConfigurationDoneRequest" in dc, "DebugClient no longer has _supportsConfigurationDoneRequest");
    dc._supportsConfigurationDoneRequest = true;
    // `initialized` follows the attach response at once: waited for before
    // attach is sent, as DebugClient's own hitBreakpoint() does with launch.
    await within(Promise.all([dc.configurationSequence(), dc.attachRequest({ type: "debugpy", request: "attach", justMyCode: true })]), "attach");
    ok();

    stage = "setBreakpointsRequest";
    let stopped = dc.waitForEvent("stopped");
    let location = dc.assertStoppedLocation("breakpoint", { path: config.path, line: config.line });
    const set = await within(dc.setBreakpointsRequest({ source, breakpoints: [{ line: config.line }] }), "setBreakpoints");
    const [bp] = set.body.breakpoints;
    assert.strictEqual(bp.verified, true, `unverified: ${JSON.stringify(bp)}`);
    assert.strictEqual(bp.line, config.line);
    ok(`id=${bp.id}`);

    stage = "stopped + assertStoppedLocation";
    const event = await within(stopped, "stopped event");
    assert.strictEqual(event.body.allThreadsStopped, false);
    assert.deepStrictEqual(event.body.hitBreakpointIds, [bp.id]);
    const threadId = event.body.threadId;
    let trace = await within(location, "stopped location");
    ok(`thread ${threadId}`);

    stage = "stackTraceRequest";
    trace = await within(dc.stackTraceRequest({ threadId, startFrame: 0, levels: 20 }), "stackTrace");
    const frames = trace.body.stackFrames;
    assert.deepStrictEqual(
        frames.slice(0, 3).map((f) => f.name),
        ["work", "train", "<module>"]
    );
    dc.assertPath(frames[0].source.path, config.path, "top frame's path");
    assert.strictEqual(frames[0].line, config.line);
    ok(frames.map((f) => `${f.name}:${f.line}`).join(" "));

    stage = "threadsRequest";
    const threads = (await within(dc.threadsRequest(), "threads")).body.threads;
    assert.ok(threads.some((t) => t.id === threadId && t.name === "MainThread"), JSON.stringify(threads));
    ok();

    stage = "scopesRequest + variablesRequest";
    const first = await stepOf(dc, frames[0].id);
    ok(`step=${first}`);

    stage = "evaluateRequest";
    const value = await within(dc.evaluateRequest({ expression: "step * 2", frameId: frames[0].id, context: "watch" }), "evaluate");
    assert.strictEqual(value.body.result, String(first * 2));
    ok();

    stage = "continueRequest";
    stopped = dc.waitForEvent("stopped");
    location = dc.assertStoppedLocation("breakpoint", { path: config.path, line: config.line });
    await within(dc.continueRequest({ threadId }), "continue");
    const again = await within(stopped, "the next stop");
    assert.strictEqual(again.body.threadId, threadId);
    const top = (await within(location, "the next stop's location")).body.stackFrames[0];
    const second = await stepOf(dc, top.id);
    assert.ok(second > first, `step went from ${first} to ${second}`);
    ok(`step=${second}`);

    stage = "disconnectRequest";
    const cleared = await within(dc.setBreakpointsRequest({ source, breakpoints: [] }), "clearing the breakpoint");
    assert.deepStrictEqual(cleared.body.breakpoints, []);
    await within(dc.continueRequest({ threadId }), "continue");
    await within(dc.disconnectRequest({}), "disconnect");
    dc.stopAdapter();
    ok();
    console.log("PASS");
    process.exit(0);
}

main().catch(fail);
