import { LabIcon } from '@jupyterlab/ui-components';

import overmindSvg from '../style/icons/overmind.svg';

/** The sidebar's tab icon: a memory chip with a spark (warm memory). */
export const overmindIcon = new LabIcon({ name: 'overmind-lab:chip', svgstr: overmindSvg });
