/**
 * The GPU slice of this JupyterLab session, from the server extension's
 * `GET <base>/slicebroker/session`:
 *
 * - a status-bar item: "GPU ×2 · vision · protected 42 min · 1.30 GPU-h", and one
 *   with the utilisation of the session's GPUs: "GPU 85%";
 * - a dialog with a live countdown when the slice is preempted (its grace period)
 *   or when the session may soon be stopped as idle, with a "Save all" button, and
 *   for the idle warning "Keep my session" (activity now, which the server logs);
 * - the command "GPU session details" (palette, and a click on the status item):
 *   the slice's details and links to the broker's pages;
 * - when the session ends after a preemption, a notice of why; for a session that
 *   comes back by itself ("Bring it back after a preemption"), its notebooks saved at
 *   once, and once it is back, a notice of when it was restored, with a way to the
 *   last cell run.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Dialog, ICommandPalette, showDialog } from '@jupyterlab/apputils';
import { PageConfig, URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

/** The answer of the server extension (times in epoch seconds, the server's clock). */
interface ISession {
  slice_id: number;
  project: string;
  user: string;
  gpus: number;
  gpu_type: string | null;
  nodes: string[];
  state: string;
  granted_at: number | null;
  protected_until: number | null;
  /** Past its preemption budget: what that promises, in words; else null. */
  kept_to_end: string | null;
  preempt_deadline: number | null;
  preempt_reason: string | null;
  end_reason: string | null;
  ended_at: number | null;
  charged_gpu_seconds: number;
  cost: string;
  now: number;
  cull_warning: {
    deadline: number;
    idle_seconds: number;
    limit_seconds: number;
    protected: boolean;
    message: string;
  } | null;
  broker_pages: string;
  activity: IActivity | null;
  /** Seconds "Extend protection" adds (0: not offered). */
  extend_protection_by: number;
  /** Whether the hub starts this session again after a preemption. */
  comes_back: boolean;
  /** While such a session is being preempted: what its preemption budget still allows. */
  budget_left: string | null;
  /** The ended slice this session restores, and when it ended (ISO 8601). */
  restored: { slice_id: number; ended_at: string } | null;
}

/** What the session last did (``slicebroker/activity``): kernels, terminals, GPUs. */
interface IActivity {
  idle_seconds: number;
  kernels_busy: number;
  gpu_busy: boolean;
  gpu: {
    source: string;
    gpus: Array<{
      index: number;
      utilization_percent: number | null;
      memory_used_mib: number | null;
      memory_total_mib: number | null;
    }>;
    problem: string | null;
  } | null;
}

const DETAILS_COMMAND = 'slicebroker:details';
const KEEP_COMMAND = 'slicebroker:keep';
const SAVE_ALL_COMMAND = 'docmanager:save-all';
/** Run silently in every kernel at a preemption: `%slicebroker_save` where the notebook
 * loaded `%load_ext slicebroker_lab` (its kept variables to disk), nothing elsewhere. */
const SAVE_KEPT_CODE =
  'if "slicebroker_save" in get_ipython().magics_manager.magics["line"]:\n' +
  '    get_ipython().run_line_magic("slicebroker_save", "")';
/** Where the last cell run is remembered, per server (a session brought back has the
 * same base URL, so the same browser finds it). */
const LAST_CELL_KEY = `slicebroker-last-cell:${PageConfig.getBaseUrl()}`;

/** The last cell run in this session's notebooks: its notebook and index. */
interface ILastCell {
  path: string;
  index: number;
}

/** Remember each cell run, so that a session brought back can lead to the last one. */
function rememberCellsRun(tracker: INotebookTracker): void {
  NotebookActions.executed.connect((_, { notebook, cell }) => {
    const panel = tracker.find(candidate => candidate.content === notebook);
    if (panel) {
      const last: ILastCell = {
        path: panel.context.path,
        index: notebook.widgets.indexOf(cell)
      };
      window.localStorage.setItem(LAST_CELL_KEY, JSON.stringify(last));
    }
  });
}

function lastCellRun(): ILastCell | null {
  try {
    return JSON.parse(window.localStorage.getItem(LAST_CELL_KEY) ?? 'null');
  } catch {
    return null;
  }
}

/** Seconds between reads of the slice; shorter while a countdown runs. */
const POLL_S = 15;
const POLL_URGENT_S = 3;

const PREEMPT_REASONS: { [key: string]: string } = {
  unallocated: 'a project with a GPU allocation needed them',
  fair_share: 'a project below its fair share needed them',
  priority: 'higher-priority work of your project needed them',
  debug_lane: 'a short debug session needed them',
  drain: 'an admin is draining the node'
};

/**
 * "42 min", "1 h 05 min"; under a minute "0:42". Whole minutes are rounded down, so
 * that time left is never promised longer than it is (7:03 left is "7 min").
 */
function minutes(seconds: number): string {
  const m = Math.floor(Math.max(seconds, 0) / 60);
  if (m < 1) {
    return clock(seconds);
  }
  if (m < 60) {
    return `${m} min`;
  }
  return `${Math.floor(m / 60)} h ${String(m % 60).padStart(2, '0')} min`;
}

/** "7:03": a countdown's minutes and seconds. */
function clock(seconds: number): string {
  const s = Math.max(Math.ceil(seconds), 0);
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, '0')}`;
}

function preemptReason(reason: string | null): string {
  return (reason && PREEMPT_REASONS[reason]) || 'the broker needed its GPUs';
}

/** Reads the slice, keeps the server's clock, and tells the views. */
class SessionModel {
  session: ISession | null = null;
  error: string | null = null;
  /** Server clock minus the browser's, in seconds. */
  private skew = 0;
  private listeners: Array<() => void> = [];
  private timer: number | undefined;
  private ended = false;

  constructor(private settings: ServerConnection.ISettings) {}

  /** The server's time now (epoch seconds). */
  now(): number {
    return Date.now() / 1000 + this.skew;
  }

  onChange(listener: () => void): void {
    this.listeners.push(listener);
  }

  /** The server is gone with its slice (``last``, as the session ended): show it so, and
   * poll no more (only the hub would answer). */
  endWith(last: ISession): void {
    this.ended = true;
    window.clearTimeout(this.timer);
    this.session = last;
    this.listeners.forEach(listener => listener());
  }

  start(): void {
    void this.refresh();
    // Polls only while the tab is visible: a background tab must not look active.
    document.addEventListener('visibilitychange', () => {
      if (!document.hidden) {
        void this.refresh();
      }
    });
  }

  /** "Keep my session": activity now, as the hub's idle rule counts it. */
  async keep(): Promise<void> {
    const url = URLExt.join(this.settings.baseUrl, 'slicebroker', 'activity');
    const init = { method: 'POST', body: JSON.stringify({ keep: true }) };
    await ServerConnection.makeRequest(url, init, this.settings);
    await this.refresh();
  }

  /** "Extend protection": null when done, else the broker's reason for refusing. */
  async extendProtection(): Promise<string | null> {
    const url = URLExt.join(this.settings.baseUrl, 'slicebroker', 'protection');
    const reply = await ServerConnection.makeRequest(
      url,
      { method: 'POST' },
      this.settings
    );
    const body = await reply.json();
    await this.refresh();
    return reply.ok ? null : (body?.error?.message ?? `HTTP ${reply.status}`);
  }

  async refresh(): Promise<void> {
    window.clearTimeout(this.timer);
    if (this.ended) {
      return;
    }
    const url = URLExt.join(this.settings.baseUrl, 'slicebroker', 'session');
    try {
      const reply = await ServerConnection.makeRequest(url, {}, this.settings);
      const body = await reply.json();
      if (reply.ok) {
        this.session = body as ISession;
        this.skew = this.session.now - Date.now() / 1000;
        this.error = null;
      } else {
        this.error = body?.error?.code ?? `HTTP ${reply.status}`;
        if (reply.status === 404) {
          this.session = null;
        }
      }
    } catch (err) {
      this.error = 'unreachable';
    }
    this.listeners.forEach(listener => listener());
    const urgent =
      this.session?.state === 'preempting' || !!this.session?.cull_warning;
    if (!document.hidden) {
      this.timer = window.setTimeout(
        () => void this.refresh(),
        (urgent ? POLL_URGENT_S : POLL_S) * 1000
      );
    }
  }
}

/** The status bar's line for a session. */
export function statusText(session: ISession, now: number): string {
  const parts = [`GPU ×${session.gpus}`, session.project];
  if (session.state === 'preempting' && session.preempt_deadline) {
    parts.push(`stops in ${clock(session.preempt_deadline - now)}`);
  } else if (session.state === 'ended') {
    parts.push(`ended (${session.end_reason ?? 'released'})`);
  } else if (session.kept_to_end) {
    parts.push('kept to its end');
  } else if (session.protected_until && session.protected_until > now) {
    parts.push(`protected ${minutes(session.protected_until - now)}`);
  } else {
    parts.push('not protected');
  }
  parts.push(session.cost);
  return parts.join(' · ');
}

/** The status bar's GPU use: "GPU 85%" (the mean over the session's GPUs), or null
 * when the GPUs could not be read. */
export function gpuUseText(activity: IActivity | null): string | null {
  const read = (activity?.gpu?.gpus ?? []).filter(g => g.utilization_percent !== null);
  if (read.length === 0) {
    return null;
  }
  const total = read.reduce((sum, g) => sum + (g.utilization_percent ?? 0), 0);
  return `GPU ${Math.round(total / read.length)}%`;
}

/** One line per GPU for the details: "GPU 2: 85%, 30.0 of 79.6 GiB". */
function gpuUseRows(activity: IActivity | null): string {
  const gpus = activity?.gpu?.gpus ?? [];
  if (gpus.length === 0) {
    return activity?.gpu?.problem ?? 'not read';
  }
  const gib = (mib: number | null) => (mib === null ? '?' : (mib / 1024).toFixed(1));
  return gpus
    .map(
      g =>
        `GPU ${g.index}: ${g.utilization_percent ?? '?'}%, ` +
        `${gib(g.memory_used_mib)} of ${gib(g.memory_total_mib)} GiB`
    )
    .join('; ');
}

/** The status bar's GPU use item (resource-usage's GPU indicator, for this session). */
class GpuUseItem extends Widget {
  constructor(private model: SessionModel) {
    super();
    this.addClass('sb-gpu-use');
    this.node.title =
      'Utilisation of this session\'s GPUs: busy GPUs keep it from being stopped as idle';
    model.onChange(() => this.render());
  }

  render(): void {
    const text = gpuUseText(this.model.session?.activity ?? null);
    this.setHidden(text === null);
    this.node.textContent = text ?? '';
  }
}

class StatusItem extends Widget {
  constructor(private model: SessionModel, onClick: () => void) {
    super();
    this.addClass('sb-status');
    this.node.title = 'GPU session details';
    this.node.addEventListener('click', onClick);
    model.onChange(() => this.render());
    window.setInterval(() => this.render(), 1000);
  }

  render(): void {
    const session = this.model.session;
    this.setHidden(session === null);
    if (session) {
      this.node.textContent = statusText(session, this.model.now());
      this.node.classList.toggle(
        'sb-urgent',
        session.state === 'preempting' || !!session.cull_warning
      );
    }
  }
}

/** The body of a countdown dialog: a message and the time left, every second. */
class CountdownBody extends Widget {
  private timer: number;

  constructor(
    private model: SessionModel,
    private deadline: () => number | null,
    message: string
  ) {
    super();
    this.addClass('sb-countdown-body');
    const text = document.createElement('p');
    text.textContent = message;
    const left = document.createElement('p');
    left.className = 'sb-countdown';
    this.node.append(text, left);
    this.tick();
    this.timer = window.setInterval(() => this.tick(), 1000);
  }

  tick(): void {
    const deadline = this.deadline();
    const left = this.node.querySelector('.sb-countdown') as HTMLElement;
    left.textContent =
      deadline === null
        ? ''
        : `Time left: ${clock(deadline - this.model.now())}`;
  }

  dispose(): void {
    window.clearInterval(this.timer);
    super.dispose();
  }
}

function hubHome(): string {
  return URLExt.join(PageConfig.getOption('hubPrefix') || '/hub/', 'home');
}

function link(href: string, text: string): HTMLAnchorElement {
  const a = document.createElement('a');
  a.href = href;
  a.target = '_blank';
  a.rel = 'noopener';
  a.textContent = text;
  return a;
}

function detailsBody(model: SessionModel): Widget {
  const body = new Widget();
  body.addClass('sb-details');
  const session = model.session;
  if (!session) {
    body.node.textContent =
      model.error === 'unreachable' || model.error === 'broker_unavailable'
        ? 'The GPU broker is not answering; the details will come back with it.'
        : 'This session has no GPU slice.';
    return body;
  }
  const now = model.now();
  const when = (t: number | null) =>
    t === null ? '—' : new Date((t - now) * 1000 + Date.now()).toLocaleString();
  const rows: Array<[string, string]> = [
    ['GPUs', `${session.gpus} × ${session.gpu_type ?? 'any type'}`],
    ['Project', session.project],
    ['Node', session.nodes.join(', ') || '—'],
    ['State', session.state],
    [
      'Protected until',
      session.kept_to_end
        ? session.kept_to_end
        : session.protected_until === null
        ? 'not protected'
        : `${when(session.protected_until)}` +
          (session.protected_until > now
            ? ` (${minutes(session.protected_until - now)} left)`
            : ' (over)')
    ],
    ['Cost so far', session.cost],
    ['Slice', `#${session.slice_id}`]
  ];
  if (session.state === 'preempting') {
    rows.push([
      'Stops at',
      `${when(session.preempt_deadline)} (${preemptReason(session.preempt_reason)})`
    ]);
  }
  if (session.end_reason) {
    rows.push(['Ended', session.end_reason]);
  }
  if (session.activity) {
    rows.push(['GPU use', gpuUseRows(session.activity)]);
    rows.push([
      'Idle',
      session.activity.kernels_busy > 0 || session.activity.gpu_busy
        ? 'no: working'
        : minutes(session.activity.idle_seconds)
    ]);
  }
  if (session.cull_warning) {
    rows.push(['Idle warning', session.cull_warning.message]);
  }
  const table = document.createElement('table');
  for (const [name, value] of rows) {
    const tr = table.insertRow();
    const th = document.createElement('th');
    th.textContent = name;
    tr.append(th);
    tr.insertCell().textContent = value;
  }
  const links = document.createElement('p');
  links.append(
    link(session.broker_pages, 'My GPUs, the queue and usage (GPU broker)'),
    document.createTextNode(' · '),
    link(hubHome(), 'Hub home')
  );
  body.node.append(table, links);
  return body;
}

/** Shows the preemption and idle dialogs, once per event. */
class Warnings {
  private shownPreemption: number | null = null;
  private shownRestored: number | null = null;
  private shownCull = false;
  private ended = false;
  private lastPreempting: ISession | null = null;
  // The countdown dialog on screen: the "ended" dialog replaces it (Lab shows one at a time).
  private open: Dialog<unknown> | null = null;

  constructor(
    private app: JupyterFrontEnd,
    private model: SessionModel
  ) {
    model.onChange(() => this.check());
  }

  check(): void {
    if (this.model.error !== null) {
      this.checkEnded();
      return;
    }
    const session = this.model.session;
    if (!session) {
      return;
    }
    if (session.restored && this.shownRestored !== session.slice_id) {
      this.shownRestored = session.slice_id;
      this.sayRestored(session);
    }
    if (session.state === 'preempting' && session.preempt_deadline !== null) {
      this.lastPreempting = session;
      if (this.shownPreemption !== session.slice_id) {
        this.shownPreemption = session.slice_id;
        const reason = preemptReason(session.preempt_reason);
        if (session.comes_back) {
          // Saved now, not when the user gets to it: the session comes back on these files.
          void this.app.commands.execute(SAVE_ALL_COMMAND);
          void this.saveKeptVariables();
        }
        void this.countdown(
          'Your GPU session is stopping',
          session.comes_back
            ? `Your GPUs were taken back: ${reason}. Your notebooks (and the variables ` +
                'marked with %slicebroker_keep) were saved. This ' +
                'session stops when the time is up, then comes back by itself, in your ' +
                "place in your project's queue, on the same files; its kernels start afresh." +
                (session.budget_left ? ` ${session.budget_left}` : '')
            : `Your GPUs were taken back: ${reason}. This session stops when the time ` +
                'is up. Save your work now; you can start a new session from the hub ' +
                'afterwards.',
          () => this.model.session?.preempt_deadline ?? null
        );
      }
    }
    if (session.cull_warning && !this.shownCull) {
      this.shownCull = true;
      void this.countdown(
        'Your GPU session may stop as idle',
        session.cull_warning.message,
        () => this.model.session?.cull_warning?.deadline ?? null,
        true
      );
    } else if (!session.cull_warning) {
      this.shownCull = false; // activity came back: a later idle spell warns again
    }
  }

  /** Past a preemption's deadline the server goes away (the hub answers for it): say
   * why, once, in place of the countdown, and in the status bar. */
  checkEnded(): void {
    const last = this.lastPreempting;
    if (
      this.ended ||
      last === null ||
      last.preempt_deadline === null ||
      this.model.now() < last.preempt_deadline - POLL_URGENT_S
    ) {
      return;
    }
    this.ended = true;
    this.open?.reject();
    this.open = null;
    this.model.endWith({ ...last, state: 'ended', end_reason: 'preempted' });
    const body = new Widget();
    body.addClass('sb-ended-body');
    body.node.append(
      document.createTextNode(
        'Your GPU session ended: its grace period after a preemption is over ' +
          `(${preemptReason(last.preempt_reason)}). It cost ${last.cost}. ` +
          (last.comes_back
            ? 'It comes back by itself: the hub is asking for GPUs again, in your place ' +
              'in the queue. '
            : '')
      ),
      link(last.broker_pages, 'My GPUs'),
      document.createTextNode(' · '),
      link(hubHome(), last.comes_back ? 'Follow it on the hub' : 'Start a new one from the hub')
    );
    void showDialog({
      title: 'GPU session ended',
      body,
      buttons: [Dialog.okButton({ label: 'Close' })]
    });
  }

  /** Ask every running kernel to write the variables it keeps (`%slicebroker_keep`). */
  private async saveKeptVariables(): Promise<void> {
    const sessions = this.app.serviceManager.sessions;
    await sessions.refreshRunning();
    for (const model of Array.from(sessions.running())) {
      const connection = sessions.connectTo({ model });
      try {
        await connection.kernel?.requestExecute({
          code: SAVE_KEPT_CODE,
          silent: true,
          store_history: false
        }).done;
      } catch (reason) {
        console.warn('slicebroker: a kernel did not save its kept variables', reason);
      } finally {
        connection.dispose();
      }
    }
  }

  /** Once per restored slice and browser: when the session came back, and from what. */
  private sayRestored(session: ISession): void {
    const key = `slicebroker-restored-${session.slice_id}`;
    if (window.localStorage.getItem(key) !== null) {
      return;
    }
    window.localStorage.setItem(key, '1');
    const restored = session.restored!;
    const local = (epoch: number | null) =>
      epoch === null ? '—' : new Date(epoch * 1000).toLocaleTimeString();
    const ended = Date.parse(restored.ended_at);
    const last = lastCellRun();
    void showDialog({
      title: 'GPU session brought back',
      body:
        `This session was restored at ${local(session.granted_at)} after a preemption ` +
        `at ${Number.isNaN(ended) ? '—' : local(ended / 1000)} (slice ${restored.slice_id}). ` +
        'Your files and layout are as you left them; the kernels restarted, so run ' +
        'again what you need.' +
        (last ? ` The last cell you ran was cell ${last.index + 1} of ${last.path}.` : ''),
      buttons: [
        Dialog.cancelButton({ label: 'Close' }),
        ...(last ? [Dialog.okButton({ label: 'Go to the last cell run' })] : [])
      ]
    }).then(result => {
      if (last && result.button.accept) {
        void this.goTo(last);
      }
    });
  }

  /** Open the notebook of ``last`` with that cell active and in view. */
  private async goTo(last: ILastCell): Promise<void> {
    const panel = await this.app.commands.execute('docmanager:open', { path: last.path });
    if (panel instanceof NotebookPanel) {
      await panel.context.ready;
      panel.content.activeCellIndex = last.index;
      if (panel.content.activeCell) {
        await panel.content.scrollToCell(panel.content.activeCell);
      }
    }
  }

  private async countdown(
    title: string,
    message: string,
    deadline: () => number | null,
    keepable = false
  ): Promise<void> {
    const body = new CountdownBody(this.model, deadline, message);
    const extendBy = this.model.session?.extend_protection_by ?? 0;
    const extra = keepable
      ? [
          Dialog.createButton({ label: 'Keep my session', actions: ['keep'] }),
          ...(extendBy > 0
            ? [
                Dialog.createButton({
                  label: `Extend protection by ${minutes(extendBy)}`,
                  actions: ['extend']
                })
              ]
            : [])
        ]
      : [];
    const dialog = new Dialog({
      title,
      body,
      buttons: [
        Dialog.cancelButton({ label: 'Dismiss' }),
        ...extra,
        Dialog.okButton({ label: 'Save all' })
      ],
      defaultButton: extra.length + 1
    });
    this.open = dialog;
    const result = await dialog.launch();
    if (this.open === dialog) {
      this.open = null;
    }
    body.dispose();
    if (result.button.actions.includes('keep')) {
      await this.app.commands.execute(KEEP_COMMAND);
    } else if (result.button.actions.includes('extend')) {
      const refused = await this.model.extendProtection();
      const session = this.model.session;
      await showDialog({
        title: refused ? 'Protection not extended' : 'Protection extended',
        body:
          refused ??
          `Your session is protected until ${
            session?.protected_until
              ? new Date(
                  (session.protected_until - this.model.now()) * 1000 + Date.now()
                ).toLocaleTimeString()
              : '—'
          }. It is charged as before, from its start to its end.`,
        buttons: [Dialog.okButton({ label: 'Close' })]
      });
    } else if (result.button.accept) {
      await this.app.commands.execute(SAVE_ALL_COMMAND);
    }
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'slicebroker-lab:plugin',
  description: 'The GPU slice of this session: status bar, warnings, details.',
  autoStart: true,
  optional: [IStatusBar, ICommandPalette, INotebookTracker],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null,
    notebooks: INotebookTracker | null
  ) => {
    const model = new SessionModel(app.serviceManager.serverSettings);
    app.commands.addCommand(DETAILS_COMMAND, {
      label: 'GPU session details',
      caption: 'The GPUs of this session, its protection, its cost and the broker pages',
      execute: async () => {
        await model.refresh();
        await showDialog({
          title: 'GPU session details',
          body: detailsBody(model),
          buttons: [Dialog.okButton({ label: 'Close' })]
        });
      }
    });
    app.commands.addCommand(KEEP_COMMAND, {
      label: 'Keep my GPU session',
      caption: 'Count as activity now, so that the session is not stopped as idle',
      execute: () => model.keep()
    });
    palette?.addItem({ command: DETAILS_COMMAND, category: 'GPU session' });
    palette?.addItem({ command: KEEP_COMMAND, category: 'GPU session' });
    if (statusBar) {
      const item = new StatusItem(model, () => {
        void app.commands.execute(DETAILS_COMMAND);
      });
      statusBar.registerStatusItem('slicebroker-lab:status', {
        item,
        align: 'left',
        rank: 100,
        isActive: () => model.session !== null
      });
      statusBar.registerStatusItem('slicebroker-lab:gpu-use', {
        item: new GpuUseItem(model),
        align: 'left',
        rank: 101,
        isActive: () => gpuUseText(model.session?.activity ?? null) !== null
      });
    }
    if (notebooks) {
      rememberCellsRun(notebooks);
    }
    new Warnings(app, model);
    model.start();
  }
};

export default plugin;
